"""Modifiers that are spellings of one placement give the same costs."""

from checker._analysis import analyze
from checker._parse import parse
from formal._model import PRECISIONS, Transformer
from formal._placement import Recompute
from formal._presets import PRESETS


def test_flash_attention_places_activations_like_selective_recomputation() -> None:
    model = PRESETS["llama3-8b"]
    assert isinstance(model, Transformer)
    flash = analyze(parse("zero3xflash", devices=16), model, PRECISIONS["zero"])
    selective = analyze(parse("zero3xselective", devices=16), model, PRECISIONS["zero"])
    none = analyze(parse("zero3", devices=16), model, PRECISIONS["zero"])
    assert flash.placement.options.recompute is Recompute.SELECTIVE
    assert flash.memory.activations == selective.memory.activations
    # Korthikanti et al. 2022 Table 2: dropping the attention scores per layer, 5as^2b with
    # dropout (softmax output, dropout mask and output); Llama 3 trains without dropout, so only
    # the 2-byte softmax output, 2as^2b, which the attention over V reads itself.
    per_as2b = 5 if model.dropout else 2
    scores = per_as2b * model.heads * model.seq**2 * model.micro_batch * model.layers
    assert none.memory.activations is not None and flash.memory.activations is not None
    assert none.memory.activations - flash.memory.activations == scores
