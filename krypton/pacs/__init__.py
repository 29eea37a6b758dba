"""The PACS in one place: a bounded DICOMweb client (:mod:`.dicomweb` over
:mod:`.transport`, which ends every request at its deadline and byte budget) and what
Krypton keeps there (:mod:`.results`: result keys, Parametric Maps and captures sent
back into the source study). A study batch over a PACS is :mod:`krypton.batch.study`."""
