"""The demo models' synthetic data: fundus photographs with planted lesions
(:mod:`.fundus`) and chest CT volumes with planted nodules (:mod:`.chestct`), each with
the lesions' true positions, for training, samples and pointing tests."""
