"""The CPU runtime: the decoder (model.py), its KV cache (kv_cache.py), weight loading (weights.py,
hub.py), tokenizer (tokenizer.py) and the C++ kernels (kernels/). It knows nothing about
sampling or speculation."""
