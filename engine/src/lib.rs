//! Tandem's engine: model loading, tokenizer, forward pass, KV cache, sampler.
