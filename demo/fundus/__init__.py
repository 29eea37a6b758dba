"""The fundus-lesion demo model: its training and evaluation (train.py: python -m
demo.fundus.train) and a second, separately written image generator (independent.py)
it is evaluated on. The generator the model was trained on, krypton.synthetic.fundus, stays in
the library: `krypton tune` draws its calibration images from it."""
