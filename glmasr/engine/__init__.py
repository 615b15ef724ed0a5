"""Engine: KV cache and the generation loop."""
