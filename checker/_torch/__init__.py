"""Ground truth from a real engine: the composition run with PyTorch's own implementations.

Optional: everything here imports torch lazily (``pip install -e '.[torch]'``); the core package
never imports this one. Entry points: ``checker._torch_validate`` (``--table``) and
``check-composition COMPOSITION --validate torch``.
"""
