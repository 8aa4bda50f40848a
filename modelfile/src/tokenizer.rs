//! Tokenizer built from GGUF `tokenizer.ggml.*` metadata (or an HF
//! `tokenizer.json`), reproducing llama.cpp's tokenization. Byte-level BPE
//! ("gpt2"): the same pre-tokenizer regexes (applied in sequence, as
//! llama.cpp's `unicode_regex_split` does), the same BPE merges, control /
//! user-defined tokens matched atomically in the input text. SentencePiece
//! ("llama"): llama.cpp's score-driven merging with byte fallback (see
//! `spm.rs`). Both decode by llama.cpp's `token_to_piece` rules.
//!
//! Decoding deliberately does not apply llama.cpp's `clean_spaces`
//! post-processing (HF's `clean_up_tokenization_spaces`): it is lossy, and a
//! serving system wants `decode(encode(text)) == text` and streamed text that
//! equals the full decode.

use std::collections::HashMap;
use std::path::Path;

use tokenizers::decoders::DecoderWrapper;
use tokenizers::decoders::byte_level::ByteLevel;
use tokenizers::models::bpe::{BPE, Merges, Vocab};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{AddedToken, SplitDelimiterBehavior};

use crate::gguf::{GgufError, GgufFile};
use crate::spm::{self, Spm, attr};

/// GGUF `tokenizer.ggml.token_type` values (llama.cpp's `llama_token_type`).
pub mod token_type {
    pub const UNDEFINED: i32 = 0;
    pub const NORMAL: i32 = 1;
    pub const UNKNOWN: i32 = 2;
    pub const CONTROL: i32 = 3;
    pub const USER_DEFINED: i32 = 4;
    pub const UNUSED: i32 = 5;
    pub const BYTE: i32 = 6;
}

#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error(
        "unsupported tokenizer model {model:?}: only byte-level BPE (\"gpt2\") and SentencePiece (\"llama\") are supported"
    )]
    Unsupported { model: String },
    #[error(
        "a {model:?} tokenizer has no exact tokenizer.json equivalent (llama.cpp's SentencePiece merging is not an HF model)"
    )]
    NoHfEquivalent { model: String },
    #[error("invalid tokenizer spec: {0}")]
    InvalidSpec(String),
    #[error("malformed merge #{index} {merge:?}: expected two tokens separated by a space")]
    MalformedMerge { index: usize, merge: String },
    #[error("merge #{index} {merge:?} refers to a token not in the vocabulary: {token:?}")]
    MergeOutOfVocab {
        index: usize,
        merge: String,
        token: String,
    },
    #[error("{what} token id {id} is out of range (vocabulary size {vocab_size})")]
    IdOutOfRange {
        what: &'static str,
        id: u32,
        vocab_size: usize,
    },
    #[error("token id {id} is out of range (vocabulary size {vocab_size})")]
    InvalidId { id: u32, vocab_size: usize },
    #[error("cannot build tokenizer: {0}")]
    Build(String),
    #[error("cannot load tokenizer from {path}: {message}")]
    Load { path: String, message: String },
    #[error("tokenization failed: {0}")]
    Encode(String),
    #[error("tokenizer metadata: {0}")]
    Gguf(#[from] GgufError),
}

/// What GGUF's tokenizer.ggml.* metadata (or an HF tokenizer.json) describes.
#[derive(Debug, Clone, Default)]
pub struct TokenizerSpec {
    /// `tokenizer.ggml.model`: "gpt2" (byte-level BPE) and "llama"
    /// (SentencePiece) are supported.
    pub model: String,
    /// `tokenizer.ggml.pre`: pre-tokenizer name ("smollm", "llama-bpe", ...).
    pub pre: Option<String>,
    pub tokens: Vec<String>,
    /// Per-token type (see [`token_type`]); may be empty (all normal).
    pub token_types: Vec<i32>,
    /// "a b" merge rules, highest priority first (BPE).
    pub merges: Vec<String>,
    /// Per-token score (SentencePiece: higher merges first); may be empty.
    pub scores: Vec<f32>,
    /// `tokenizer.ggml.add_space_prefix` (SentencePiece; llama.cpp's
    /// default is true).
    pub add_space_prefix: Option<bool>,
    /// `general.name`: llama.cpp sets some token attributes by model name
    /// (phi-3's special tokens eat the whitespace after them).
    pub model_name: Option<String>,
    pub bos_id: Option<u32>,
    pub eos_id: Option<u32>,
    pub unk_id: Option<u32>,
    pub pad_id: Option<u32>,
    /// End-of-turn token, if the metadata names one.
    pub eot_id: Option<u32>,
    pub add_bos: bool,
    pub add_eos: bool,
}

/// Token texts llama.cpp recognises as end-of-turn when metadata names none.
const EOT_NAMES: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "<｜end▁of▁sentence｜>",
    "<end_of_utterance>",
];

/// Token texts llama.cpp treats as end-of-generation (llama-vocab.cpp).
const EOG_NAMES: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|flush|>",
    "<|calls|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "</s>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "[EOS]",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<eos>",
    "<turn|>",
    "<|tool_response>",
    "<｜end▁of▁sentence｜>",
    "[e~[",
];

const GPT2_RE: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)";
const LLAMA3_RE: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN2_RE: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// DeepSeek's splits: newlines, then letter runs (Latin, Greek, Cyrillic,
/// ... spelled out), punctuation runs, trailing whitespace, CJK runs, digits.
const DEEPSEEK_LLM_RES: &[&str] = &[
    "[\r\n]",
    "\\s?[A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ-ᵷᵹ-ᶚḀ-ἕἘ-Ἕἠ-ὅὈ-Ὅὐ-ὗὙὛὝὟ-ώᾀ-ᾴᾶ-ᾼιῂ-ῄῆ-ῌῐ-ΐῖ-Ίῠ-Ῥῲ-ῴῶ-ῼℂℇℊ-ℓℕℙ-ℝℤΩℨK-ℭℯ-ℴℹℼ-ℿⅅ-ⅉⅎↃↄⰀ-ⱻⱾ-ⳤⳫ-ⳮⳲⳳꙀ-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇꞋ-ꞎꭰ-ꮿﬀ-ﬆﬓ-ﬗＡ-Ｚａ-ｚ\u{10400}-\u{1044f}\u{104b0}-\u{104d3}\u{104d8}-\u{104fb}\u{10c80}-\u{10cb2}\u{10cc0}-\u{10cf2}\u{118a0}-\u{118df}\u{1e900}-\u{1e943}]+",
    "\\s?[!-/:-~！-／：-～‘-‟\u{3000}-。]+",
    "\\s+$",
    "[一-龥ࠀ-一가-\u{d7ff}]+",
    "\\p{N}+",
];
const DEEPSEEK_CODER_RES: &[&str] = &[
    "[\r\n]",
    "\\s?\\p{L}+",
    "\\s?\\p{P}+",
    "[一-龥ࠀ-一가-\u{d7ff}]+",
    "\\p{N}",
];
const QWEN35_RE: &str = "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?[\\p{L}\\p{M}]+|\\p{N}| ?[^\\s\\p{L}\\p{M}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";

/// A llama.cpp pre-tokenizer preset: its regexes (applied one after another,
/// each splitting the pieces of the previous one) and flags.
struct PrePreset {
    name: &'static str,
    regexes: &'static [&'static str],
    ignore_merges: bool,
    default_add_bos: bool,
}

fn pre_preset(name: Option<&str>) -> (PrePreset, bool) {
    let preset = |name, regexes, ignore_merges, default_add_bos| PrePreset {
        name,
        regexes,
        ignore_merges,
        default_add_bos,
    };
    let found = match name.unwrap_or("") {
        "" | "default" => Some(preset(
            "default",
            &[
                r"[\p{P}\$\+<=>\^~\|]+",
                GPT2_RE,
                r"\p{N}+",
                r"[0-9][0-9][0-9]",
            ],
            false,
            false,
        )),
        "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "falcon-h1" | "pixtral" | "midm-2.0"
        | "lfm2" => Some(preset("llama3", &[LLAMA3_RE], true, true)),
        "dbrx" | "smaug-bpe" | "chatglm-bpe" => Some(preset("llama3", &[LLAMA3_RE], false, false)),
        "glm4" | "glm5" => Some(preset("llama3", &[LLAMA3_RE], true, false)),
        "gpt2" | "gpt-2" | "phi-2" | "jina-es" | "jina-de" | "gigachat" | "jina-v2-es"
        | "jina-v2-de" | "a.x-4.0" | "mellum" | "modern-bert" | "exaone4" | "mpt" | "olmo"
        | "jais" | "jina-v1-en" | "jina-v2-code" | "roberta-bpe" => {
            Some(preset("gpt2", &[GPT2_RE], false, false))
        }
        "smollm" | "starcoder" | "refact" | "command-r" | "codeshell" | "exaone" | "minerva-7b"
        | "mellum2" => Some(preset("smollm", &[r"\p{N}", GPT2_RE], false, false)),
        "qwen35" => Some(preset("qwen35", &[QWEN35_RE], false, false)),
        "deepseek-llm" => Some(preset("deepseek-llm", DEEPSEEK_LLM_RES, false, false)),
        "deepseek-coder" => Some(preset("deepseek-coder", DEEPSEEK_CODER_RES, false, false)),
        "qwen2" | "deepseek-r1-qwen" | "kormo" | "f2llmv2" | "megrez" | "stablelm2" | "hunyuan"
        | "solar-open" => Some(preset("qwen2", &[QWEN2_RE], false, false)),
        "falcon" => Some(preset(
            "falcon",
            &[
                r"[\p{P}\$\+<=>\^~\|`]+",
                r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
                r"[0-9][0-9][0-9]",
            ],
            false,
            false,
        )),
        _ => None,
    };
    match found {
        Some(p) => (p, false),
        None => (preset("gpt2", &[GPT2_RE], false, false), true),
    }
}

/// GPT-2's byte-to-unicode table, inverted: char -> byte.
fn byte_level_decoder() -> HashMap<char, u8> {
    let mut map = HashMap::with_capacity(256);
    let mut n = 0u32;
    for b in 0u32..256 {
        let printable =
            (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
        let c = if printable {
            b
        } else {
            n += 1;
            255 + n
        };
        if let Some(c) = char::from_u32(c) {
            map.insert(c, b as u8);
        }
    }
    map
}

/// Raw bytes of a byte-level token text; the text itself if some char is not
/// in the byte-level alphabet (as llama.cpp and HF's ByteLevel decoder do).
fn byte_level_bytes(table: &HashMap<char, u8>, text: &str) -> Vec<u8> {
    text.chars()
        .map(|c| table.get(&c).copied())
        .collect::<Option<Vec<u8>>>()
        .unwrap_or_else(|| text.as_bytes().to_vec())
}

/// SentencePiece-style token text: "<0xAB>" byte tokens, '▁' for space.
fn spm_bytes(text: &str) -> Vec<u8> {
    if text.len() == 6
        && text.starts_with("<0x")
        && text.ends_with('>')
        && let Ok(b) = u8::from_str_radix(&text[3..5], 16)
    {
        return vec![b];
    }
    text.replace('\u{2581}', " ").into_bytes()
}

pub struct Tokenizer {
    backend: Backend,
    tokens: Vec<String>,
    /// Raw bytes each token decodes to (llama.cpp's token_to_piece, special=true).
    pieces: Vec<Vec<u8>>,
    /// Tokens hidden by `skip_special` (control / unknown).
    hidden: Vec<bool>,
    token_to_id: HashMap<String, u32>,
    bos_id: Option<u32>,
    eos_id: Option<u32>,
    eot_id: Option<u32>,
    add_bos: bool,
    add_eos: bool,
    stop_ids: Vec<u32>,
    pre_name: &'static str,
    /// The control tokens' texts (`<|im_start|>`, ...): client text that
    /// spells one must not become the control token.
    controls: aho_corasick::AhoCorasick,
}

/// Ids of short pieces of prompt text encoded before. A chat template's
/// own text (role headers, the default system prompt) recurs in every
/// request, and tokenizing it was the largest share of a router's CPU per
/// short request. Encoding is a pure function of the piece, so a hit is
/// exactly what encoding would give. Bounded: emptied when full.
#[derive(Default)]
struct PieceCache(std::sync::Mutex<PieceMap>);

/// Pieces are kept from their second sighting on, so text that occurs once
/// (most client text) is only hashed, never stored.
#[derive(Default)]
struct PieceMap {
    seen: std::collections::HashSet<u64>,
    ids: HashMap<Box<str>, Box<[u32]>>,
}

impl PieceCache {
    const ENTRIES: usize = 512;
    const MAX_PIECE_BYTES: usize = 2048;

    fn encode(
        &self,
        t: &tokenizers::Tokenizer,
        s: &str,
        out: &mut Vec<u32>,
    ) -> Result<(), TokenizerError> {
        let key =
            (s.len() <= Self::MAX_PIECE_BYTES).then(|| xxhash_rust::xxh3::xxh3_64(s.as_bytes()));
        let mut keep = false;
        if let Some(k) = key {
            let mut map = self
                .0
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            if let Some(ids) = map.ids.get(s) {
                out.extend_from_slice(ids);
                return Ok(());
            }
            if map.seen.len() >= Self::ENTRIES {
                map.seen.clear();
            }
            keep = !map.seen.insert(k);
        }
        let enc = t
            .encode_fast(s, false)
            .map_err(|e| TokenizerError::Encode(e.to_string()))?;
        out.extend_from_slice(enc.get_ids());
        if keep {
            let mut map = self
                .0
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            if map.ids.len() >= Self::ENTRIES {
                map.ids.clear();
            }
            map.ids.insert(s.into(), enc.get_ids().into());
        }
        Ok(())
    }
}

enum Backend {
    /// Byte-level BPE: the HF tokenizer, and the same without its added
    /// tokens (for plain text).
    Bpe {
        inner: tokenizers::Tokenizer,
        /// Built on first use: only client text that spells a control
        /// token needs it, and it is a second copy of the vocabulary and
        /// merges (memory a router would otherwise hold for nothing).
        plain: std::sync::OnceLock<tokenizers::Tokenizer>,
        /// Ids of `inner` pieces seen before.
        cache: PieceCache,
        /// Every control token is an added token of `inner` that is
        /// matched as is (no stripping, not normalized), so `inner` encodes
        /// a text as the pieces between control tokens, encoded apart.
        split_on_controls: bool,
    },
    /// SentencePiece, over `Tokenizer::token_to_id`.
    Spm(Spm),
}

/// `inner` without its added tokens.
fn without_added_tokens(inner: &tokenizers::Tokenizer) -> tokenizers::Tokenizer {
    let mut plain = tokenizers::Tokenizer::new(inner.get_model().clone());
    plain.with_normalizer(inner.get_normalizer().cloned());
    plain.with_pre_tokenizer(inner.get_pre_tokenizer().cloned());
    plain.with_decoder(inner.get_decoder().cloned());
    plain
}

/// A search for the texts of the hidden (control / unknown) tokens.
fn control_search(
    tokens: &[String],
    hidden: &[bool],
) -> Result<aho_corasick::AhoCorasick, TokenizerError> {
    let texts: Vec<&str> = tokens
        .iter()
        .zip(hidden)
        .filter(|&(t, &h)| h && !t.is_empty())
        .map(|(t, _)| t.as_str())
        .collect();
    aho_corasick::AhoCorasick::builder()
        .match_kind(aho_corasick::MatchKind::LeftmostLongest)
        .build(texts)
        .map_err(|e| TokenizerError::Build(format!("control token search: {e}")))
}

/// Whether every control token text is an added token of `inner` matched
/// verbatim (see `Backend::Bpe::split_on_controls`).
fn controls_split(inner: &tokenizers::Tokenizer, tokens: &[String], hidden: &[bool]) -> bool {
    let added = inner.get_added_tokens_decoder();
    let verbatim: std::collections::HashSet<&str> = added
        .values()
        .filter(|a| !a.lstrip && !a.rstrip && !a.single_word && !a.normalized)
        .map(|a| a.content.as_str())
        .collect();
    inner.get_normalizer().is_none()
        && tokens
            .iter()
            .zip(hidden)
            .filter(|&(t, &h)| h && !t.is_empty())
            .all(|(t, _)| verbatim.contains(t.as_str()))
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.tokens.len())
            .field("pre", &self.pre_name)
            .field("bos_id", &self.bos_id)
            .field("eos_id", &self.eos_id)
            .field("eot_id", &self.eot_id)
            .field("add_bos", &self.add_bos)
            .field("add_eos", &self.add_eos)
            .finish_non_exhaustive()
    }
}

fn build_err(e: impl std::fmt::Display) -> TokenizerError {
    TokenizerError::Build(e.to_string())
}

/// Lowest id whose text is one of `names`.
fn find_named(tokens: &[String], names: &[&str]) -> Option<u32> {
    tokens
        .iter()
        .position(|t| names.contains(&t.as_str()))
        .and_then(|i| u32::try_from(i).ok())
}

/// eos + eot + every token llama.cpp marks end-of-generation by its text.
fn compute_stop_ids(tokens: &[String], eos: Option<u32>, eot: Option<u32>) -> Vec<u32> {
    let mut ids: Vec<u32> = tokens
        .iter()
        .enumerate()
        .filter(|(_, t)| EOG_NAMES.contains(&t.as_str()))
        .filter_map(|(i, _)| u32::try_from(i).ok())
        .collect();
    ids.extend(eos);
    ids.extend(eot);
    ids.sort_unstable();
    ids.dedup();
    ids
}

/// Checks what both tokenizer models need of a spec.
fn validate(spec: &TokenizerSpec) -> Result<(), TokenizerError> {
    let n = spec.tokens.len();
    if n == 0 {
        return Err(TokenizerError::InvalidSpec("empty vocabulary".into()));
    }
    if u32::try_from(n).is_err() {
        return Err(TokenizerError::InvalidSpec(format!(
            "vocabulary too large: {n}"
        )));
    }
    if !spec.token_types.is_empty() && spec.token_types.len() != n {
        return Err(TokenizerError::InvalidSpec(format!(
            "{} token types for {n} tokens",
            spec.token_types.len()
        )));
    }
    if !spec.scores.is_empty() && spec.scores.len() != n {
        return Err(TokenizerError::InvalidSpec(format!(
            "{} scores for {n} tokens",
            spec.scores.len()
        )));
    }
    for (what, id) in [
        ("BOS", spec.bos_id),
        ("EOS", spec.eos_id),
        ("UNK", spec.unk_id),
        ("PAD", spec.pad_id),
        ("EOT", spec.eot_id),
    ] {
        if let Some(id) = id
            && id as usize >= n
        {
            return Err(TokenizerError::IdOutOfRange {
                what,
                id,
                vocab_size: n,
            });
        }
    }
    Ok(())
}

impl Tokenizer {
    /// Builds the tokenizer llama.cpp would build from this GGUF metadata.
    pub fn from_spec(spec: TokenizerSpec) -> Result<Tokenizer, TokenizerError> {
        match spec.model.as_str() {
            "gpt2" => Self::from_bpe_spec(spec),
            "llama" => Self::from_spm_spec(spec),
            _ => Err(TokenizerError::Unsupported { model: spec.model }),
        }
    }

    fn from_bpe_spec(spec: TokenizerSpec) -> Result<Tokenizer, TokenizerError> {
        validate(&spec)?;
        let n = spec.tokens.len();
        let (preset, fell_back) = pre_preset(spec.pre.as_deref());
        if fell_back {
            tracing::warn!(
                pre = spec.pre.as_deref().unwrap_or(""),
                "unknown pre-tokenizer; using the GPT-2 pre-tokenizer regex"
            );
        }

        // Vocabulary: like llama.cpp's token_to_id map, a later duplicate wins.
        let mut token_to_id: HashMap<String, u32> = HashMap::with_capacity(n);
        for (i, t) in spec.tokens.iter().enumerate() {
            token_to_id.insert(t.clone(), i as u32);
        }
        let vocab: Vocab = token_to_id.iter().map(|(k, v)| (k.clone(), *v)).collect();

        // Merges: llama.cpp splits at the first space after the first character.
        let mut merges: Merges = Vec::with_capacity(spec.merges.len());
        for (index, merge) in spec.merges.iter().enumerate() {
            let first_len = merge.chars().next().map_or(0, char::len_utf8);
            let split = merge
                .get(first_len..)
                .and_then(|rest| rest.find(' '))
                .map(|p| p + first_len);
            let Some(split) = split else {
                return Err(TokenizerError::MalformedMerge {
                    index,
                    merge: merge.clone(),
                });
            };
            let (a, b) = (&merge[..split], &merge[split + 1..]);
            if b.is_empty() {
                return Err(TokenizerError::MalformedMerge {
                    index,
                    merge: merge.clone(),
                });
            }
            for token in [a.to_string(), b.to_string(), format!("{a}{b}")] {
                if !token_to_id.contains_key(&token) {
                    return Err(TokenizerError::MergeOutOfVocab {
                        index,
                        merge: merge.clone(),
                        token,
                    });
                }
            }
            merges.push((a.to_string(), b.to_string()));
        }

        let bpe = BPE::builder()
            .vocab_and_merges(vocab, merges)
            .ignore_merges(preset.ignore_merges)
            .build()
            .map_err(build_err)?;

        let mut pre: Vec<PreTokenizerWrapper> = Vec::with_capacity(preset.regexes.len() + 1);
        for re in preset.regexes {
            let split = Split::new(
                SplitPattern::Regex((*re).to_string()),
                SplitDelimiterBehavior::Isolated,
                false,
            )
            .map_err(build_err)?;
            pre.push(PreTokenizerWrapper::Split(split));
        }
        pre.push(PreTokenizerWrapper::ByteLevel(ByteLevel::new(
            false, false, false,
        )));

        let mut inner = tokenizers::Tokenizer::new(bpe);
        inner.with_pre_tokenizer(Some(PreTokenizerWrapper::Sequence(Sequence::new(pre))));
        inner.with_decoder(Some(DecoderWrapper::ByteLevel(ByteLevel::default())));

        let ty = |i: usize| {
            spec.token_types
                .get(i)
                .copied()
                .unwrap_or(token_type::NORMAL)
        };
        // llama.cpp forces EOT/EOG-named tokens to control type.
        let forced_control = |t: &str| EOG_NAMES.contains(&t) || EOT_NAMES.contains(&t);

        let table = byte_level_decoder();
        let mut pieces = Vec::with_capacity(n);
        let mut hidden = Vec::with_capacity(n);
        let mut special_tokens = Vec::new();
        for (i, text) in spec.tokens.iter().enumerate() {
            let mut t = ty(i);
            if forced_control(text) && t != token_type::USER_DEFINED {
                t = token_type::CONTROL;
            }
            let piece = match t {
                token_type::CONTROL | token_type::UNKNOWN | token_type::USER_DEFINED => {
                    text.as_bytes().to_vec()
                }
                token_type::NORMAL | token_type::UNDEFINED => byte_level_bytes(&table, text),
                token_type::BYTE => spm_bytes(text),
                _ => Vec::new(), // unused and unknown types decode to nothing
            };
            pieces.push(piece);
            hidden.push(matches!(t, token_type::CONTROL | token_type::UNKNOWN));
            if matches!(
                t,
                token_type::CONTROL | token_type::UNKNOWN | token_type::USER_DEFINED
            ) && !text.is_empty()
            {
                special_tokens.push(AddedToken::from(text.clone(), true));
            }
        }
        inner.add_special_tokens(&special_tokens);

        let eot_id = spec.eot_id.or_else(|| find_named(&spec.tokens, EOT_NAMES));
        let stop_ids = compute_stop_ids(&spec.tokens, spec.eos_id, eot_id);
        let controls = control_search(&spec.tokens, &hidden)?;
        Ok(Tokenizer {
            controls,
            backend: Backend::Bpe {
                plain: std::sync::OnceLock::new(),
                split_on_controls: controls_split(&inner, &spec.tokens, &hidden),
                inner,
                cache: PieceCache::default(),
            },
            tokens: spec.tokens,
            pieces,
            hidden,
            token_to_id,
            bos_id: spec.bos_id,
            eos_id: spec.eos_id,
            eot_id,
            add_bos: spec.add_bos,
            add_eos: spec.add_eos,
            stop_ids,
            pre_name: if fell_back { "gpt2" } else { preset.name },
        })
    }

    /// SentencePiece ("llama"), as llama.cpp's `llm_tokenizer_spm`.
    fn from_spm_spec(spec: TokenizerSpec) -> Result<Tokenizer, TokenizerError> {
        validate(&spec)?;
        let n = spec.tokens.len();
        // llama.cpp renames empty tokens (so they cannot match text).
        let tokens: Vec<String> = spec
            .tokens
            .into_iter()
            .enumerate()
            .map(|(i, t)| {
                if t.is_empty() {
                    format!("[EMPTY_{i}]")
                } else {
                    t
                }
            })
            .collect();
        let mut attrs: Vec<u16> = if spec.token_types.is_empty() {
            vec![attr::NORMAL; n]
        } else {
            spec.token_types
                .iter()
                .map(|&t| spm::attr_of_type(t))
                .collect()
        };
        // llama.cpp makes end-of-generation tokens control tokens.
        for (a, t) in attrs.iter_mut().zip(&tokens) {
            if EOG_NAMES.contains(&t.as_str()) {
                *a |= attr::CONTROL;
            }
        }
        // Like llama.cpp's token_to_id, a later duplicate wins.
        let mut token_to_id: HashMap<String, u32> = HashMap::with_capacity(n);
        for (i, t) in tokens.iter().enumerate() {
            token_to_id.insert(t.clone(), i as u32);
        }
        // llama.cpp's per-model attributes: phi-3's special tokens eat the
        // whitespace after them, except <unk>, <s> and <|endoftext|>.
        let name = spec.model_name.as_deref().unwrap_or("").to_lowercase();
        if name.contains("phi-3") || name.contains("phi3") {
            for a in attrs.iter_mut().filter(|a| **a & attr::SPECIAL != 0) {
                *a |= attr::RSTRIP;
            }
            let mut set = |t: &str, on: bool| {
                if let Some(a) = token_to_id
                    .get(t)
                    .and_then(|&id| attrs.get_mut(id as usize))
                {
                    *a = if on {
                        *a | attr::RSTRIP
                    } else {
                        *a & !attr::RSTRIP
                    };
                }
            };
            set("</s>", true);
            for t in ["<unk>", "<s>", "<|endoftext|>"] {
                set(t, false);
            }
        }

        let pieces: Vec<Vec<u8>> = tokens
            .iter()
            .zip(&attrs)
            .map(|(t, &a)| spm::piece_bytes(t, a))
            .collect();
        let hidden: Vec<bool> = attrs.iter().map(|&a| a & attr::HIDDEN != 0).collect();
        let eot_id = spec.eot_id.or_else(|| find_named(&tokens, EOT_NAMES));
        let stop_ids = compute_stop_ids(&tokens, spec.eos_id, eot_id);
        let controls = control_search(&tokens, &hidden)?;
        let model = Spm::new(
            &tokens,
            attrs,
            spec.scores,
            &token_to_id,
            spec.unk_id,
            spec.add_space_prefix.unwrap_or(true),
        )?;
        Ok(Tokenizer {
            backend: Backend::Spm(model),
            tokens,
            pieces,
            hidden,
            token_to_id,
            bos_id: spec.bos_id,
            eos_id: spec.eos_id,
            eot_id,
            add_bos: spec.add_bos,
            add_eos: spec.add_eos,
            stop_ids,
            pre_name: "spm",
            controls,
        })
    }

    /// Loads an HF `tokenizer.json`. BOS/EOS and add_bos/add_eos come from a
    /// `tokenizer_config.json` next to it when present; `add_bos` overrides.
    pub fn from_hf_file(path: &Path, add_bos: Option<bool>) -> Result<Tokenizer, TokenizerError> {
        let load_err = |message: String| TokenizerError::Load {
            path: path.display().to_string(),
            message,
        };
        let inner = tokenizers::Tokenizer::from_file(path).map_err(|e| load_err(e.to_string()))?;

        let vocab = inner.get_vocab(true);
        let n = vocab.values().map(|&id| id as usize + 1).max().unwrap_or(0);
        if n == 0 {
            return Err(load_err("empty vocabulary".into()));
        }
        let mut tokens = vec![String::new(); n];
        for (text, &id) in &vocab {
            tokens[id as usize] = text.clone();
        }
        let token_to_id: HashMap<String, u32> = vocab;

        let decoder_json = inner
            .get_decoder()
            .and_then(|d| serde_json::to_string(d).ok())
            .unwrap_or_default();
        let byte_level = decoder_json.contains("\"ByteLevel\"");
        let added = inner.get_added_tokens_decoder();
        let table = byte_level_decoder();
        let mut pieces = Vec::with_capacity(n);
        let mut hidden = Vec::with_capacity(n);
        for (i, text) in tokens.iter().enumerate() {
            let added_token = u32::try_from(i).ok().and_then(|id| added.get(&id));
            match added_token {
                Some(tok) => {
                    pieces.push(tok.content.as_bytes().to_vec());
                    hidden.push(tok.special);
                }
                None => {
                    pieces.push(if byte_level {
                        byte_level_bytes(&table, text)
                    } else {
                        spm_bytes(text)
                    });
                    hidden.push(false);
                }
            }
        }

        // tokenizer_config.json: bos/eos token strings, add_bos/add_eos flags.
        let config: Option<serde_json::Value> = path
            .parent()
            .map(|d| d.join("tokenizer_config.json"))
            .and_then(|p| std::fs::read_to_string(p).ok())
            .and_then(|s| serde_json::from_str(&s).ok());
        let token_field = |key: &str| -> Option<u32> {
            let v = config.as_ref()?.get(key)?;
            let s = v
                .as_str()
                .or_else(|| v.get("content").and_then(|c| c.as_str()))?;
            token_to_id.get(s).copied()
        };
        let bool_field = |key: &str| -> Option<bool> { config.as_ref()?.get(key)?.as_bool() };
        let bos_id = token_field("bos_token");
        let eos_id = token_field("eos_token");
        let post_json = inner
            .get_post_processor()
            .and_then(|p| serde_json::to_string(p).ok())
            .unwrap_or_default();
        let bos_in_post = bos_id
            .and_then(|id| tokens.get(id as usize))
            .is_some_and(|t| post_json.contains(&format!("\"{t}\"")));
        let add_bos = add_bos
            .or_else(|| bool_field("add_bos_token"))
            .unwrap_or(bos_in_post);
        let add_eos = bool_field("add_eos_token").unwrap_or(false);

        let eot_id = find_named(&tokens, EOT_NAMES);
        let stop_ids = compute_stop_ids(&tokens, eos_id, eot_id);
        let controls = control_search(&tokens, &hidden)?;
        Ok(Tokenizer {
            controls,
            backend: Backend::Bpe {
                plain: std::sync::OnceLock::new(),
                split_on_controls: controls_split(&inner, &tokens, &hidden),
                inner,
                cache: PieceCache::default(),
            },
            tokens,
            pieces,
            hidden,
            token_to_id,
            bos_id,
            eos_id,
            eot_id,
            add_bos,
            add_eos,
            stop_ids,
            pre_name: "hf",
        })
    }

    /// Tokenizes `text`; special tokens written in it are matched atomically.
    /// `add_special` adds BOS/EOS as `add_bos`/`add_eos` say.
    pub fn encode(&self, text: &str, add_special: bool) -> Result<Vec<u32>, TokenizerError> {
        self.encode_protected(text, add_special, &[])
    }

    /// [`Tokenizer::encode`] of the whole `text`, except that control and
    /// unknown token texts overlapping a `protected` byte range (client
    /// text in a rendered prompt) are not matched as those tokens: they
    /// are tokenized as plain text. With no protected range this is
    /// `encode`.
    ///
    /// SentencePiece: one pass over the whole text, as llama.cpp would
    /// tokenize it, so the space prefix goes only at the start and after
    /// special tokens, never at a protected range's edges. Byte-level BPE:
    /// each protected range is pre-tokenized on its own, like the text
    /// between two special tokens (what `encode` of the text around it plus
    /// [`Tokenizer::encode_plain`] of it gives).
    ///
    /// Ranges must lie on character boundaries of `text`; they may come in
    /// any order and overlap.
    pub fn encode_protected(
        &self,
        text: &str,
        add_special: bool,
        protected: &[std::ops::Range<usize>],
    ) -> Result<Vec<u32>, TokenizerError> {
        let mut ranges: Vec<std::ops::Range<usize>> = Vec::with_capacity(protected.len());
        let mut sorted: Vec<&std::ops::Range<usize>> =
            protected.iter().filter(|r| !r.is_empty()).collect();
        sorted.sort_by_key(|r| r.start);
        for r in sorted {
            if r.end > text.len()
                || !text.is_char_boundary(r.start)
                || !text.is_char_boundary(r.end)
            {
                return Err(TokenizerError::Encode(format!(
                    "protected range {r:?} is not on character boundaries of a {}-byte text",
                    text.len()
                )));
            }
            match ranges.last_mut() {
                // Only overlaps merge: adjacent BPE ranges stay separate
                // pieces, as separate `encode_plain` calls made them.
                Some(last) if r.start < last.end => last.end = last.end.max(r.end),
                _ => ranges.push(r.clone()),
            }
        }

        let mut out = Vec::new();
        if add_special
            && self.add_bos
            && let Some(bos) = self.bos_id
        {
            out.push(bos);
        }
        match &self.backend {
            Backend::Bpe {
                inner,
                plain,
                cache,
                split_on_controls,
            } => {
                let mut at = 0;
                for r in &ranges {
                    // The template's text (cached: it recurs), then the
                    // client's (not cached: it rarely does).
                    if at < r.start {
                        cache.encode(inner, &text[at..r.start], &mut out)?;
                    }
                    let enc = plain
                        .get_or_init(|| without_added_tokens(inner))
                        .encode_fast(&text[r.clone()], false)
                        .map_err(|e| TokenizerError::Encode(e.to_string()))?;
                    out.extend_from_slice(enc.get_ids());
                    at = r.end;
                }
                if *split_on_controls {
                    // A rendered prompt's pieces between control tokens
                    // (role headers, the default system prompt) recur.
                    let base = at;
                    for m in self.controls.find_iter(&text[base..]) {
                        let (start, end) = (base + m.start(), base + m.end());
                        if at < start {
                            cache.encode(inner, &text[at..start], &mut out)?;
                        }
                        let id = self.token_to_id.get(&text[start..end]).ok_or_else(|| {
                            TokenizerError::Encode("a control token without an id".into())
                        })?;
                        out.push(*id);
                        at = end;
                    }
                }
                if at < text.len() {
                    cache.encode(inner, &text[at..], &mut out)?;
                }
            }
            Backend::Spm(m) => {
                m.encode_protected(&self.token_to_id, text, true, &ranges, &mut out)?;
            }
        }
        if add_special
            && self.add_eos
            && let Some(eos) = self.eos_id
        {
            out.push(eos);
        }
        Ok(out)
    }

    /// Byte ranges of `text` that spell a control token.
    pub fn control_texts(&self, text: &str) -> Vec<std::ops::Range<usize>> {
        self.controls.find_iter(text).map(|m| m.range()).collect()
    }

    /// Tokenizes `text` as plain text: a control token's text written in
    /// it is split like any other text (no BOS/EOS). SentencePiece: like
    /// llama.cpp without `parse_special`, user-defined tokens still match,
    /// and the text gets the space prefix as `encode`'s does.
    pub fn encode_plain(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        match &self.backend {
            Backend::Bpe { plain, inner, .. } => {
                let enc = plain
                    .get_or_init(|| without_added_tokens(inner))
                    .encode_fast(text, false)
                    .map_err(|e| TokenizerError::Encode(e.to_string()))?;
                Ok(enc.get_ids().to_vec())
            }
            Backend::Spm(m) => {
                let mut out = Vec::new();
                m.encode(&self.token_to_id, text, false, &mut out)?;
                Ok(out)
            }
        }
    }

    fn piece(&self, id: u32, skip_special: bool) -> Result<&[u8], TokenizerError> {
        let i = id as usize;
        let piece = self.pieces.get(i).ok_or(TokenizerError::InvalidId {
            id,
            vocab_size: self.pieces.len(),
        })?;
        if skip_special && self.hidden.get(i).copied().unwrap_or(false) {
            Ok(&[])
        } else {
            Ok(piece)
        }
    }

    /// Text of `ids`; bytes that are not valid UTF-8 become U+FFFD.
    /// SentencePiece with `add_space_prefix`: as llama.cpp's detokenizer,
    /// the first token loses one leading space (the one encoding added),
    /// unless `skip_special` drops a leading BOS (then nothing is stripped),
    /// and `skip_special` also drops a trailing EOS when `add_eos`.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String, TokenizerError> {
        let mut ids = ids;
        let mut strip_space = false;
        if let Backend::Spm(m) = &self.backend {
            strip_space = m.add_space_prefix();
            if skip_special
                && self.add_bos
                && let Some((&first, rest)) = ids.split_first()
                && Some(first) == self.bos_id
            {
                strip_space = false;
                ids = rest;
            }
            if skip_special
                && self.add_eos
                && let Some((&last, rest)) = ids.split_last()
                && Some(last) == self.eos_id
            {
                ids = rest;
            }
        }
        let mut bytes = Vec::new();
        for &id in ids {
            let mut piece = self.piece(id, skip_special)?;
            if strip_space {
                piece = piece.strip_prefix(b" ").unwrap_or(piece);
                strip_space = false;
            }
            bytes.extend_from_slice(piece);
        }
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }

    /// Raw bytes of one token (control tokens included, as their text).
    pub fn token_to_piece_bytes(&self, id: u32) -> Option<Vec<u8>> {
        self.pieces.get(id as usize).cloned()
    }

    pub fn vocab_size(&self) -> usize {
        self.tokens.len()
    }

    /// Whether `id` is a control or unknown token (hidden when decoding
    /// with `skip_special`): text can never spell it.
    pub fn is_special(&self, id: u32) -> bool {
        self.hidden.get(id as usize).copied().unwrap_or(false)
    }

    pub fn bos_id(&self) -> Option<u32> {
        self.bos_id
    }

    pub fn eos_id(&self) -> Option<u32> {
        self.eos_id
    }

    /// End-of-turn token (from metadata, or found by name as llama.cpp does).
    pub fn eot_id(&self) -> Option<u32> {
        self.eot_id
    }

    pub fn add_bos(&self) -> bool {
        self.add_bos
    }

    /// Tokens that end generation: EOS, EOT and the tokens llama.cpp marks
    /// end-of-generation by their text ("<|im_end|>", "<|endoftext|>", ...).
    pub fn stop_ids(&self) -> Vec<u32> {
        self.stop_ids.clone()
    }

    /// Token text as stored in the vocabulary (byte-level form for BPE).
    pub fn token_str(&self, id: u32) -> Option<&str> {
        self.tokens.get(id as usize).map(String::as_str)
    }

    pub fn token_id(&self, s: &str) -> Option<u32> {
        self.token_to_id.get(s).copied()
    }

    /// Name of the pre-tokenizer preset in use ("smollm", "gpt2", "llama3",
    /// "qwen2", "default", "falcon", ...; "hf" for a tokenizer.json, "spm"
    /// for SentencePiece). An unknown GGUF pre-tokenizer name falls back to
    /// "gpt2".
    pub fn pre_tokenizer(&self) -> &'static str {
        self.pre_name
    }

    /// The underlying HF tokenizer, serialized as tokenizer.json. A
    /// SentencePiece tokenizer has none: an error.
    pub fn to_hf_json(&self) -> Result<String, TokenizerError> {
        match &self.backend {
            Backend::Bpe { inner, .. } => inner.to_string(false).map_err(build_err),
            Backend::Spm(_) => Err(TokenizerError::NoHfEquivalent {
                model: "llama".into(),
            }),
        }
    }

    pub fn stream_decoder(&self, skip_special: bool) -> StreamDecoder<'_> {
        StreamDecoder {
            tokenizer: self,
            skip_special,
            pending: Vec::new(),
        }
    }
}

/// Reads the tokenizer metadata of a GGUF file into a [`TokenizerSpec`].
pub fn spec_from_gguf(g: &GgufFile) -> Result<TokenizerSpec, TokenizerError> {
    fn opt<'a, T>(
        g: &'a GgufFile,
        key: &str,
        get: impl FnOnce(&'a GgufFile, &str) -> Result<T, GgufError>,
    ) -> Result<Option<T>, TokenizerError> {
        if g.get(key).is_some() {
            Ok(Some(get(g, key)?))
        } else {
            Ok(None)
        }
    }
    let model = g.get_str("tokenizer.ggml.model")?.to_string();
    let pre = opt(g, "tokenizer.ggml.pre", GgufFile::get_str)?.map(str::to_string);
    let tokens: Vec<String> = g
        .get_str_array("tokenizer.ggml.tokens")?
        .into_iter()
        .map(str::to_string)
        .collect();
    let token_types =
        opt(g, "tokenizer.ggml.token_type", GgufFile::get_i32_array)?.unwrap_or_default();
    let merges: Vec<String> = opt(g, "tokenizer.ggml.merges", GgufFile::get_str_array)?
        .unwrap_or_default()
        .into_iter()
        .map(str::to_string)
        .collect();
    // Scores are f32, or i32 in some older conversions.
    let scores = match g.get("tokenizer.ggml.scores") {
        None => Vec::new(),
        Some(_) => match g.get_f32_array("tokenizer.ggml.scores") {
            Ok(v) => v,
            Err(_) => g
                .get_i32_array("tokenizer.ggml.scores")?
                .into_iter()
                .map(|v| v as f32)
                .collect(),
        },
    };
    let spm = model == "llama";
    let n = tokens.len();
    // llama.cpp's SentencePiece defaults: <unk>=0, <s>=1, </s>=2, BOS on.
    let default_id = |id: u32| (spm && (id as usize) < n).then_some(id);
    let id =
        |key: &str, default: Option<u32>| opt(g, key, GgufFile::get_u32).map(|v| v.or(default));
    let (preset, _) = pre_preset(pre.as_deref());
    let add_bos = opt(g, "tokenizer.ggml.add_bos_token", GgufFile::get_bool)?
        .unwrap_or(spm || preset.default_add_bos);
    let add_eos = opt(g, "tokenizer.ggml.add_eos_token", GgufFile::get_bool)?.unwrap_or(false);
    Ok(TokenizerSpec {
        model,
        pre,
        tokens,
        token_types,
        merges,
        scores,
        add_space_prefix: opt(g, "tokenizer.ggml.add_space_prefix", GgufFile::get_bool)?,
        model_name: opt(g, "general.name", GgufFile::get_str)?.map(str::to_string),
        bos_id: id("tokenizer.ggml.bos_token_id", default_id(1))?,
        eos_id: id("tokenizer.ggml.eos_token_id", default_id(2))?,
        unk_id: id("tokenizer.ggml.unknown_token_id", default_id(0))?,
        pad_id: id("tokenizer.ggml.padding_token_id", None)?,
        eot_id: id("tokenizer.ggml.eot_token_id", None)?,
        add_bos,
        add_eos,
    })
}

/// Incremental detokenizer for streaming: push token ids one at a time, get
/// back the text that is now complete. Never splits a UTF-8 character: an
/// incomplete trailing byte sequence is held back until the bytes completing
/// it arrive; invalid bytes become U+FFFD exactly as in [`Tokenizer::decode`],
/// so the concatenated output equals `decode` of the whole sequence, except
/// that it decodes a continuation: it never strips the leading space that
/// `decode` strips for SentencePiece with `add_space_prefix`.
#[derive(Debug)]
pub struct StreamDecoder<'a> {
    tokenizer: &'a Tokenizer,
    skip_special: bool,
    pending: Vec<u8>,
}

impl StreamDecoder<'_> {
    pub fn push(&mut self, id: u32) -> Result<String, TokenizerError> {
        let piece = self.tokenizer.piece(id, self.skip_special)?;
        self.pending.extend_from_slice(piece);
        let mut out = String::new();
        let mut start = 0;
        while start < self.pending.len() {
            match std::str::from_utf8(&self.pending[start..]) {
                Ok(s) => {
                    out.push_str(s);
                    start = self.pending.len();
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    out.push_str(&String::from_utf8_lossy(
                        &self.pending[start..start + valid],
                    ));
                    match e.error_len() {
                        Some(bad) => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            start += valid + bad;
                        }
                        None => {
                            // Incomplete sequence at the end: wait for more.
                            start += valid;
                            break;
                        }
                    }
                }
            }
        }
        self.pending.drain(..start);
        Ok(out)
    }

    /// Flushes what is held back (an incomplete sequence becomes U+FFFD).
    pub fn finish(&mut self) -> String {
        let out = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        out
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    /// A tiny byte-level vocab: all 256 byte tokens, a few merges, one
    /// control token.
    fn tiny() -> Tokenizer {
        let table = byte_level_decoder();
        let mut by_byte: Vec<(u8, char)> = table.iter().map(|(c, b)| (*b, *c)).collect();
        by_byte.sort();
        let mut tokens: Vec<String> = vec!["<|end|>".into()];
        tokens.extend(by_byte.iter().map(|(_, c)| c.to_string()));
        let ch = |b: u8| by_byte[b as usize].1;
        // "ðŁ" = bytes F0 9F (emoji lead), "ĠĠ" = two spaces
        let m1 = format!("{} {}", ch(0xF0), ch(0x9F));
        let m2 = format!("{} {}", ch(b' '), ch(b' '));
        tokens.push(format!("{}{}", ch(0xF0), ch(0x9F)));
        tokens.push(format!("{}{}", ch(b' '), ch(b' ')));
        let mut types = vec![token_type::NORMAL; tokens.len()];
        types[0] = token_type::CONTROL;
        Tokenizer::from_spec(TokenizerSpec {
            model: "gpt2".into(),
            pre: Some("gpt2".into()),
            tokens,
            token_types: types,
            merges: vec![m1, m2],
            eos_id: Some(0),
            ..Default::default()
        })
        .expect("tiny tokenizer")
    }

    fn stream(tok: &Tokenizer, ids: &[u32], skip: bool) -> (Vec<String>, String) {
        let mut d = tok.stream_decoder(skip);
        let mut parts: Vec<String> = ids.iter().map(|&id| d.push(id).expect("push")).collect();
        parts.push(d.finish());
        let joined = parts.concat();
        (parts, joined)
    }

    #[test]
    fn tiny_roundtrip_and_merges() {
        let tok = tiny();
        let text = "a   b 👋<|end|>é";
        let ids = tok.encode(text, false).unwrap();
        assert!(
            ids.contains(&0),
            "control token matched atomically: {ids:?}"
        );
        assert!(ids.contains(&tok.token_id("ĠĠ").unwrap()));
        assert!(ids.contains(&tok.token_id("ðŁ").unwrap()));
        assert_eq!(tok.decode(&ids, false).unwrap(), text);
        assert_eq!(tok.decode(&ids, true).unwrap(), "a   b 👋é");
        assert_eq!(tok.stop_ids(), vec![0]);
    }

    #[test]
    fn cached_template_pieces_encode_as_fresh_ones() {
        let (tok, fresh) = (tiny(), tiny());
        let text = "<|end|>sys  prompt 👋\n<|end|>user: CLIENT<|end|>  tail";
        let client = text.find("CLIENT").unwrap();
        let client = client..client + 6;
        let ranges = std::slice::from_ref(&client);
        let want = fresh.encode_protected(text, false, ranges).unwrap();
        for _ in 0..3 {
            assert_eq!(tok.encode_protected(text, false, ranges).unwrap(), want);
        }
        // Split at control tokens and cached, as one pass of the HF
        // tokenizer over the whole text gives.
        let Backend::Bpe {
            inner,
            split_on_controls,
            ..
        } = &tok.backend
        else {
            panic!("tiny is BPE")
        };
        assert!(*split_on_controls);
        for _ in 0..3 {
            let direct = inner.encode_fast(text, false).unwrap();
            assert_eq!(tok.encode(text, false).unwrap(), direct.get_ids());
        }
        // Past the cache's bound it is emptied, never wrong.
        for i in 0..PieceCache::ENTRIES + 10 {
            let t = format!("<|end|>head {i} <|end|>x");
            let last = t.len() - 1..t.len();
            let r = std::slice::from_ref(&last);
            assert_eq!(
                tok.encode_protected(&t, false, r).unwrap(),
                fresh.encode_protected(&t, false, r).unwrap()
            );
        }
        assert_eq!(tok.encode_protected(text, false, ranges).unwrap(), want);
    }

    #[test]
    fn stream_holds_back_partial_utf8() {
        let tok = tiny();
        // 👋 = F0 9F 91 8B: tokens "ðŁ", then single bytes 0x91, 0x8B.
        let ids = tok.encode("x👋y", false).unwrap();
        assert_eq!(ids.len(), 5, "{ids:?}");
        let (parts, joined) = stream(&tok, &ids, false);
        assert_eq!(parts, vec!["x", "", "", "👋", "y", ""]);
        assert_eq!(joined, tok.decode(&ids, false).unwrap());
    }

    #[test]
    fn stream_matches_decode_on_invalid_and_truncated_bytes() {
        let tok = tiny();
        let byte = |b: u8| b as u32 + 1; // byte tokens follow the control token
        let cases: Vec<Vec<u32>> = vec![
            vec![byte(0xF0), byte(0x9F), byte(b'a')], // truncated then ASCII
            vec![byte(0xFF), byte(b'a'), byte(0xC3)], // invalid, then dangling lead
            vec![byte(0xE2), 0, byte(0x82), byte(0xAC)], // control token splits a char
            vec![byte(0xC3), byte(0xA9), byte(0x80)], // é then stray continuation
        ];
        for ids in cases {
            for skip in [false, true] {
                let (_, joined) = stream(&tok, &ids, skip);
                assert_eq!(
                    joined,
                    tok.decode(&ids, skip).unwrap(),
                    "{ids:?} skip={skip}"
                );
            }
        }
    }

    #[test]
    fn stream_rejects_bad_id() {
        let tok = tiny();
        let mut d = tok.stream_decoder(false);
        assert!(matches!(
            d.push(1_000_000),
            Err(TokenizerError::InvalidId { .. })
        ));
        assert!(tok.decode(&[1_000_000], false).is_err());
    }

    #[test]
    fn merge_split_rules() {
        let tok = tiny();
        assert_eq!(tok.vocab_size(), 259);
        let mut spec = TokenizerSpec {
            model: "gpt2".into(),
            tokens: vec!["a".into(), "b".into(), "ab".into()],
            merges: vec!["ab".into()],
            ..Default::default()
        };
        assert!(matches!(
            Tokenizer::from_spec(spec.clone()),
            Err(TokenizerError::MalformedMerge { .. })
        ));
        spec.merges = vec!["a c".into()];
        assert!(matches!(
            Tokenizer::from_spec(spec.clone()),
            Err(TokenizerError::MergeOutOfVocab { .. })
        ));
        spec.merges = vec!["a b".into()];
        let tok = Tokenizer::from_spec(spec).unwrap();
        assert_eq!(tok.encode("ab", false).unwrap(), vec![2]);
    }
}
