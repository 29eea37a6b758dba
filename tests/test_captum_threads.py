"""The Captum drop-in under threads and older Captum (krypton.captum).

One instance called from two threads (a server handling two requests with one explainer)
left forward_func pointing at a finished call's session in 2 of 4 runs, with spurious
warnings, wrong last_engine reports and later calls off the fast path. Under Captum 0.8,
which lacks the method the drop-in hooks, the engine never ran while last_engine still
said "krypton", without a warning."""

import threading
import warnings

import pytest
import torch
from captum.attr import Occlusion as CaptumOcclusion
from torch import nn

from krypton import captum as dropin
from krypton.captum import Occlusion


def small_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4),
    ).eval()  # fmt: skip


@pytest.mark.parametrize("attempt", range(20))
def test_one_instance_serves_four_threads_at_once(attempt):
    model = small_net()
    explainer = Occlusion(model)
    inputs = [
        torch.rand(1, 3, 24, 24, generator=torch.Generator().manual_seed(n)) for n in range(4)
    ]
    expected = [
        CaptumOcclusion(model).attribute(x, sliding_window_shapes=(3, 6, 6), strides=3, target=n)
        for n, x in enumerate(inputs)
    ]
    got: dict[int, tuple] = {}
    start = threading.Barrier(4)

    def call(n: int) -> None:
        start.wait()
        try:
            attribute(n)
        except Exception as exc:  # said in the assertion below, not lost in the thread
            got[n] = (exc, None, [])

    def attribute(n: int) -> None:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            found = explainer.attribute(
                inputs[n], sliding_window_shapes=(3, 6, 6), strides=3, target=n
            )
        got[n] = (found, explainer.last_engine, [str(w.message) for w in caught])

    threads = [threading.Thread(target=call, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    for n in range(4):
        found, engine, caught = got[n]
        assert not isinstance(found, Exception), repr(found)
        torch.testing.assert_close(found, expected[n], atol=1e-5, rtol=0)
        assert engine == "krypton", (n, engine)
        assert not [w for w in caught if "krypton.captum" in w], caught  # nothing spurious
    assert explainer.forward_func is model  # no call left its session behind
    again = explainer.attribute(inputs[0], sliding_window_shapes=(3, 6, 6), strides=3, target=0)
    torch.testing.assert_close(again, expected[0], atol=1e-5, rtol=0)
    assert explainer.last_engine == "krypton"


def test_without_captums_seam_the_drop_in_is_captum_and_says_so(monkeypatch):
    model = small_net()
    x = torch.rand(1, 3, 24, 24)
    expected = CaptumOcclusion(model).attribute(
        x, sliding_window_shapes=(3, 6, 6), strides=3, target=1
    )
    assert dropin.seam_available()  # the pinned Captum (0.9) has it
    monkeypatch.setattr(dropin, "seam_available", lambda: False)  # as under Captum 0.8
    explainer = Occlusion(model)
    with pytest.warns(UserWarning, match="Captum 0.9 added it"):
        found = explainer.attribute(x, sliding_window_shapes=(3, 6, 6), strides=3, target=1)
    torch.testing.assert_close(found, expected, atol=1e-6, rtol=0)
    assert explainer.last_engine == "captum" and explainer.last_strategy is None
