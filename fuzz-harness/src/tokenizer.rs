//! The real SmolLM2 tokenizer (from `TANDEM_TEST_GGUF`) on arbitrary text:
//! decoding what `encode` and `encode_plain` produce gives the text back
//! (for text whose every character the vocabulary can spell: SmolLM2's has
//! no token for 21 of the 256 bytes, among them 0x04 and the UTF-8 lead
//! bytes 0xF1 and 0xF2, and drops them exactly as Hugging Face's tokenizer
//! does), plain encoding never yields a control token and equals `encode`
//! on text that spells none, and decoding arbitrary ids never panics.

use std::sync::LazyLock;

use tandem_modelfile::ModelMeta;
use tandem_modelfile::tokenizer::Tokenizer;

static TOK: LazyLock<Tokenizer> = LazyLock::new(|| {
    let path = std::env::var_os("TANDEM_TEST_GGUF")
        .expect("set TANDEM_TEST_GGUF to SmolLM2-135M-Instruct.Q4_1.gguf");
    ModelMeta::load(std::path::Path::new(&path))
        .expect("model metadata")
        .text
        .tokenizer
});

/// One fuzz input.
pub fn run(data: &[u8]) {
    let tok = &*TOK;
    if let Ok(text) = std::str::from_utf8(data) {
        let ids = tok.encode(text, false).expect("encode");
        let plain = tok.encode_plain(text).expect("encode_plain");
        let spellable = text.chars().all(|c| {
            let c = c.to_string();
            let ids = tok.encode_plain(&c).expect("encode_plain");
            tok.decode(&ids, false).ok().as_deref() == Some(c.as_str())
        });
        if spellable {
            assert_eq!(tok.decode(&ids, false).expect("decode"), text);
            assert_eq!(tok.decode(&plain, false).expect("decode"), text);
        }
        if tok.control_texts(text).is_empty() {
            assert_eq!(ids, plain, "{text:?}");
        }
        // Plain text never becomes a control token (the guard against
        // forged chat turns relies on it).
        assert!(
            plain.iter().all(|&t| !tok.is_special(t)),
            "{text:?} -> {plain:?}"
        );
    }
    let ids: Vec<u32> = data
        .chunks(2)
        .map(|c| u32::from(c[0]) | (u32::from(*c.get(1).unwrap_or(&0)) << 8))
        .collect();
    let _ = tok.decode(&ids, true);
    let mut s = tok.stream_decoder(true);
    for &id in &ids {
        let _ = s.push(id);
    }
}
