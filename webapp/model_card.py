"""What the page says about a model (its card: what it is, each measured number with the
set it was measured on) and about an image its out-of-distribution check flags."""

from __future__ import annotations

from krypton.registry.ood import caveat


def _flagged_word(flagged: bool) -> str:
    return "flagged" if flagged else "not flagged"


def model_card_lines(loaded) -> list[str]:
    """What the page says about a model: what it is, each measured number with the set it
    was measured on, whether images are checked against its training distribution."""
    from krypton.approximate.tuning import choose_tau

    entry = loaded.extra.get("entry", {})
    lines = [
        loaded.description or loaded.name,
        f"{len(loaded.classes)} classes · input {loaded.input_size[0]}×{loaded.input_size[1]}",
    ]
    evaluation = entry.get("evaluation") or {}
    held_out, independent = evaluation.get("held_out"), evaluation.get("independent")
    if held_out:
        text = (
            f"Accuracy {held_out['accuracy']:.1%} on {held_out['images']} held-out images of "
            f"{held_out['test_set']}"
        )
        if independent:
            text += (
                f"; {independent['accuracy']:.1%} on {independent['images']} images of "
                f"{independent['test_set']}"
            )
        lines.append(text + ".")
    samples = evaluation.get("real_samples")
    if samples:
        micro = samples["microaneurysms"]
        lines.append(
            f"Real photographs: the Retina sample (no lesion) → {samples['retina']['class']} "
            f"(p {samples['retina']['p']:.2f}); the Microaneurysms sample → {micro['class']} "
            f"(p {micro['p']:.2f}), lowest heatmap cell "
            f"{'on' if micro['lowest_on_dot'] else 'not on'} one of its visible dark dots."
        )
    pointing, multi = (
        evaluation.get("pointing_game_strict"),
        evaluation.get("multi_lesion_coverage"),
    )
    if pointing and multi:
        region = pointing.get("hit_rate_region")
        lines.append(
            f"Strict pointing game {pointing['hit_rate']:.0%}"
            + ("" if region is None else f" by the lowest cell, {region:.0%} by the lowest region")
            + f" ({pointing['images']} single-lesion images, patch {pointing.get('patch', 16)}, "
            f"stride {pointing.get('stride', 8)}: within 8 px of the lesion); "
            f"multi-lesion coverage {multi['share']:.0%} ({multi['lesions']} lesions in "
            f"{multi['images']} images with 2-4, patch {multi.get('patch', 16)}: lesions under "
            f"the lowest 5% of cells)."
        )
    training = entry.get("training") or {}
    if not held_out and "held_out_accuracy" in training:
        pointing = training.get("pointing_game")  # a comparison's control has none
        lines.append(
            f"Held-out accuracy {training['held_out_accuracy']:.1%}"
            + ("" if pointing is None else f", pointing game {pointing:.0%}")
            + " (this project's generator"
            + ("" if pointing is None else ", single-lesion images")
            + ")"
        )
    if loaded.ood is not None:
        rates = evaluation.get("ood")
        text = (
            f"Out-of-distribution check: on (fitted on {loaded.ood.reference}; it flags an "
            f"image whose features at some stage of the network are unusually far from "
            f"theirs"
            + (
                f" or on the side of {loaded.ood.outliers:,} synthetic counter-examples"
                if loaded.ood.boundary is not None
                else ""
            )
            + ", and by design about 1% of genuine images)"
        )
        if rates and "natural_flagged" not in rates:  # another demo's sets: named as they are
            text += f"; flags {_rates_text(rates)}"
        elif rates:
            whole = (
                f"{rates['natural_whole_flagged']} of {rates['natural_whole_images']} natural "
                f"photographs as shipped and "
                if "natural_whole_flagged" in rates
                else ""
            )
            documents = (
                f"{rates['documents_flagged']:.0%} of {rates['documents_images']} typeset "
                f"text pages, "
                if "documents_flagged" in rates
                else ""
            )
            text += (
                f"; flags {whole}{rates['natural_flagged']:.0%} of {rates['natural_images']} "
                f"natural photographs and crops, {documents}"
                f"{rates['in_distribution_flagged']:.1%} of "
                f"{rates['in_distribution_images']} fresh in-distribution images"
            )
            real = rates.get("real_flagged")
            if real:
                text += (
                    f"; the real Retina sample {_flagged_word(real['retina'])}, the "
                    f"Microaneurysms sample {_flagged_word(real['microaneurysms'])}, "
                    f"{real['microaneurysm_tiles']} of its 9 tiles flagged"
                )
            scans = rates.get("tomography")
            if scans:
                samples = scans["app_samples_flagged"]
                text += (
                    f"; real CT and MR: {sum(samples.values())} of the {len(samples)} CT and "
                    f"MR samples here flagged, {scans['held_out_flagged']:.0%} of "
                    f"{scans['held_out_slices']} held-out slices (public test scans, "
                    f"never used to fit the check)"
                )
        lines.append(text + ".")
    else:
        lines.append(
            "Out-of-distribution check: none for this model (register it with reference "
            "images to get one); its predictions on unfamiliar images are not flagged."
        )
    tuning = loaded.tuning
    lines.append(
        f"Approximate mode: {tuning.describe()}"
        if tuning
        else f"Approximate mode: τ {choose_tau(None).source}"
    )
    return lines


RATE_WORDS = {
    "in_distribution": "fresh in-distribution images",
    "independent": "images of an independently written generator",
}


def _rates_text(rates: dict) -> str:
    """'100% of 40 head ct, ..., 0.3% of 300 fresh in-distribution images': each set a
    card measured its check on (``NAME_flagged`` beside ``NAME_images``)."""
    parts = []
    for key, share in rates.items():
        name = key.removesuffix("_flagged")
        count = rates.get(f"{name}_images")
        if key.endswith("_flagged") and isinstance(share, (int, float)) and count:
            words = RATE_WORDS.get(name, name.replace("_", " "))
            parts.append(f"{share:.1%} of {count} {words}")
    return ", ".join(parts) or "nothing measured yet"


def ood_text(ood: dict | None) -> str:
    """The page's warning for an image the model's reference set says is unfamiliar."""
    text = caveat(ood)
    return f"Warning: {text}." if text else ""
