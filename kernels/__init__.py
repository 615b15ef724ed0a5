"""Triton kernels of the GLM-ASR engine, one family per module; importing this package loads nothing heavy.

Modules: rmsnorm (rms_norm), layernorm (layer_norm), rope (build_rope_cache, rope_, rope_and_append),
kv_append (kv_append), decode_attention (decode_attention), activations (swiglu, gelu_bias). Each module also
holds the plain-PyTorch reference ``*_ref`` with the same interface. Import the module you need, e.g.
``from glmasr_kernels.rmsnorm import rms_norm``.
"""
