"""The public API of ``formal`` is what ``__all__`` lists, and every listed name exists."""

import formal

PUBLIC = {
    "Axis", "Composition", "CompositionError", "Condition", "DEFAULT_DEVICES", "DEFAULT_DEVICE_MEMORY",
    "DEFAULT_MODEL", "DEFAULT_PRECISION", "Entry", "Ffn", "Group", "InputError", "LIBRARY", "Memory",
    "Mode", "Model", "ModelError", "Norm", "Obligation", "Op", "OpKind", "Options", "Origin",
    "PRECISIONS", "PRESETS", "ParameterCount", "Phase", "Placement", "PlacementError", "Precision",
    "Recompute", "Reduce", "Schedule", "SolverError", "State", "Status", "StepProgram", "Strategy",
    "StrategyFileError", "Traffic", "Transformer", "Verdict", "Violation", "bubble_fraction",
    "communication", "decide", "derive_program", "gradient_origins", "group_sizes",
    "in_flight_micro_batches", "megatron_parameter_count", "memory", "most_loaded", "total_bytes",
    "transfers",
}


def test_public_api_is_pinned() -> None:
    assert set(formal.__all__) == PUBLIC
    assert len(formal.__all__) == len(PUBLIC)  # no name listed twice


def test_every_public_name_resolves() -> None:
    for name in formal.__all__:
        assert getattr(formal, name) is not None, name
