"""Triton and CUDA kernels of the GLM-ASR engine, one family per module; importing this package loads nothing
heavy.

Modules: rmsnorm (rms_norm), layernorm (layer_norm), rope (build_rope_cache, rope_, rope_and_append),
kv_append (kv_append), decode_attention (decode_attention), encoder_attention (encoder_attention), activations
(swiglu, gelu_bias), skinny_gemm (the decode GEMVs), greedy_commit (the decode step's argmax and bookkeeping),
lstm_cell (the VAD's LSTM), ctc_viterbi (the aligner's CTC Viterbi: ctc_viterbi_forward, ctc_viterbi_paths),
logmel (the CUDA log-mel frontend), cuda_gemv (the one-row decode GEMVs in CUDA: gemv, gemv_swiglu); aot (the
kernel manifest and the ahead-of-time build behind `glmasr compile`). Each kernel module also holds the
plain-PyTorch reference ``*_ref`` with the same interface. Import the module you need, e.g.
``from glmasr_kernels.rmsnorm import rms_norm``.
"""
