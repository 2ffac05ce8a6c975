"""The engine layer: the decoder interface and every loop written against it (generate, stream,
batched sampling, beam search, speculative decoding, serving), the samplers, prefix reuse,
quantized kernels and the int8 KV cache."""
