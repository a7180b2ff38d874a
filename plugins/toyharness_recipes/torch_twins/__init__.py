"""The built-in recipes' PyTorch twins (toyharness.bench.torch_side.TorchTwin): independent
implementations of their models in PyTorch (eager, float32), written from the model descriptions,
not from the engine code. They are the numerical truth the parity tests check our first losses
against, and PyTorch's side of `toyharness bench`. Each recipe imports its twin inside its
``torch_reference`` method: nothing here loads unless bench or parity asks, and only with torch
installed (``pip install torch==2.13.0``)."""
