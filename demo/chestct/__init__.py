"""The chest-CT nodule demo model (3-D): its training and evaluation (train.py: python -m
demo.chestct.train) and a second, separately written volume generator (independent.py)
it is evaluated on. The generator it was trained on, krypton.synthetic.chestct, stays in the
library."""
