"""The models the engine runs, behind one interface (interface.py): the plain-PyTorch reference (glmasr.py with
encoder.py, projector.py, decoder.py, layers.py) and the GPU path on the Triton kernels (fast.py with
fast_weights.py, fast_encoder.py, fast_decoder.py, kernel_support.py); kv_cache.py is the decoder's cache."""
