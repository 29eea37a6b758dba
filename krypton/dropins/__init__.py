"""Drop-ins for other libraries' occlusion classes that are those classes, their occluded
forwards computed by Krypton's engine: Captum's ``Occlusion`` (:mod:`.captum`, public as
``krypton.captum``) and MONAI's ``OcclusionSensitivity`` (:mod:`.monai`, public as
``krypton.monai``); :mod:`.shared` is what both share."""
