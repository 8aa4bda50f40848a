//! The real SmolLM2 tokenizer (from `TANDEM_TEST_GGUF`) on arbitrary text:
//! decoding what `encode` and `encode_plain` produce gives the text back
//! (for text whose every character the vocabulary can spell: SmolLM2's has
//! no token for 21 of the 256 bytes, among them 0x04 and the UTF-8 lead
//! bytes 0xF1 and 0xF2, and drops them exactly as Hugging Face's tokenizer
//! does), plain encoding never yields a control token and equals `encode`
//! on text that spells none, and decoding arbitrary ids never panics.
//! The body is `tandem_fuzz_harness::tokenizer`.

#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| tandem_fuzz_harness::tokenizer::run(data));
