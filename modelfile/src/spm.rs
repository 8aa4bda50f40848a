//! SentencePiece tokenization as llama.cpp runs it for GGUF vocabularies
//! whose `tokenizer.ggml.model` is "llama" (llama.cpp's `llm_tokenizer_spm`):
//!
//! 1. special tokens (control, user-defined, unknown) are split out of the
//!    text first, longest token text first, each token's occurrences left
//!    to right, optionally eating the whitespace next to them (phi-3);
//! 2. each remaining piece of text gets a leading space when it starts the
//!    text or follows a special token (`add_space_prefix`), and its spaces
//!    become U+2581;
//! 3. the piece is cut into UTF-8 characters, and adjacent symbols whose
//!    concatenation is a token are merged, highest token score first (the
//!    leftmost pair on a tie), until no pair is a token;
//! 4. a symbol that is not a token becomes its bytes' `<0xXX>` tokens.
//!
//! Written from llama.cpp's behaviour (src/llama-vocab.cpp), not its code.

use std::cmp::Ordering;
use std::collections::{BTreeMap, BinaryHeap, HashMap};
use std::ops::Range;

use aho_corasick::{AhoCorasick, MatchKind};

use crate::tokenizer::TokenizerError;

/// SentencePiece's stand-in for a space.
pub(crate) const SPACE: char = '\u{2581}';

/// llama.cpp's per-token attribute bits (`llama_token_attr`).
pub(crate) mod attr {
    pub const UNKNOWN: u16 = 1 << 1;
    pub const UNUSED: u16 = 1 << 2;
    pub const NORMAL: u16 = 1 << 3;
    pub const CONTROL: u16 = 1 << 4;
    pub const USER_DEFINED: u16 = 1 << 5;
    pub const BYTE: u16 = 1 << 6;
    pub const LSTRIP: u16 = 1 << 8;
    pub const RSTRIP: u16 = 1 << 9;
    /// Split out of the text before tokenizing it.
    pub const SPECIAL: u16 = CONTROL | USER_DEFINED | UNKNOWN;
    /// Hidden when decoding without special tokens; never produced from
    /// plain text.
    pub const HIDDEN: u16 = CONTROL | UNKNOWN;
}

/// A GGUF `tokenizer.ggml.token_type` as llama.cpp's attribute bits.
pub(crate) fn attr_of_type(ty: i32) -> u16 {
    use crate::tokenizer::token_type as t;
    match ty {
        t::NORMAL => attr::NORMAL,
        t::UNKNOWN => attr::UNKNOWN,
        t::CONTROL => attr::CONTROL,
        t::USER_DEFINED => attr::USER_DEFINED,
        t::UNUSED => attr::UNUSED,
        t::BYTE => attr::BYTE,
        _ => 0, // undefined: decodes to nothing
    }
}

/// The bytes a token decodes to (llama.cpp's `token_to_piece` with special
/// tokens rendered): special tokens as their text, normal tokens with
/// U+2581 as a space, byte tokens as their byte, anything else as nothing.
pub(crate) fn piece_bytes(text: &str, attrs: u16) -> Vec<u8> {
    if attrs & (attr::SPECIAL) != 0 {
        text.as_bytes().to_vec()
    } else if attrs & attr::NORMAL != 0 {
        text.replace(SPACE, " ").into_bytes()
    } else if attrs & attr::BYTE != 0 {
        text.get(3..5)
            .and_then(|h| u8::from_str_radix(h, 16).ok())
            .map_or_else(Vec::new, |b| vec![b])
    } else {
        Vec::new()
    }
}

/// Whether `b` is whitespace to C's `isspace` (what llama.cpp strips next
/// to an lstrip / rstrip token).
fn c_isspace(b: u8) -> bool {
    matches!(b, b' ' | b'\t' | b'\n' | 0x0b | 0x0c | b'\r')
}

/// Whether `r` overlaps one of `ranges` (sorted, disjoint, so their ends
/// are sorted too).
fn overlaps(ranges: &[Range<usize>], r: Range<usize>) -> bool {
    let i = ranges.partition_point(|p| p.start < r.end);
    i > 0 && ranges[i - 1].end > r.start
}

/// A piece of the input after special tokens are split out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Fragment {
    Text(Range<usize>),
    Token(u32),
}

/// The special tokens, for splitting them out of text.
struct Specials {
    /// All occurrences of every special text (overlapping).
    search: Option<AhoCorasick>,
    /// Per pattern: token id, its precedence (0 first), its attributes.
    ids: Vec<u32>,
    rank: Vec<u32>,
    attrs: Vec<u16>,
}

/// A SentencePiece model: scores, byte tokens and special-token search
/// over a vocabulary kept by the caller (`Tokenizer::token_to_id`).
pub(crate) struct Spm {
    scores: Vec<f32>,
    attrs: Vec<u16>,
    /// `<0xXX>` token per byte (or the byte itself as a token).
    byte_ids: [Option<u32>; 256],
    unk_id: Option<u32>,
    add_space_prefix: bool,
    specials: Specials,
}

impl std::fmt::Debug for Spm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Spm")
            .field("vocab_size", &self.attrs.len())
            .field("add_space_prefix", &self.add_space_prefix)
            .finish_non_exhaustive()
    }
}

/// A candidate merge of two adjacent symbols.
#[derive(Debug, Clone, Copy)]
struct Bigram {
    score: f32,
    left: usize,
    right: usize,
    /// Byte length of the merged text: a stale candidate no longer matches.
    size: usize,
}

// The heap pops the highest score, then the leftmost pair.
impl Ord for Bigram {
    fn cmp(&self, other: &Self) -> Ordering {
        self.score
            .total_cmp(&other.score)
            .then_with(|| other.left.cmp(&self.left))
    }
}
impl PartialOrd for Bigram {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl PartialEq for Bigram {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}
impl Eq for Bigram {}

/// A run of input text in the merge chain (llama.cpp's `llm_symbol`).
#[derive(Debug, Clone, Copy)]
struct Symbol {
    start: usize,
    len: usize,
    prev: Option<usize>,
    next: Option<usize>,
}

impl Spm {
    /// `texts` are the token texts (as the vocabulary map holds them),
    /// `attrs` their attribute bits, `scores` one per token (or empty: all
    /// zero). `vocab` maps a text to its id.
    pub(crate) fn new(
        texts: &[String],
        attrs: Vec<u16>,
        scores: Vec<f32>,
        vocab: &HashMap<String, u32>,
        unk_id: Option<u32>,
        add_space_prefix: bool,
    ) -> Result<Self, TokenizerError> {
        let n = texts.len();
        let scores = if scores.is_empty() {
            vec![0.0; n]
        } else if scores.len() >= n {
            scores
        } else {
            return Err(TokenizerError::InvalidSpec(format!(
                "{} scores for {n} tokens",
                scores.len()
            )));
        };
        let mut byte_ids = [None; 256];
        for (b, slot) in byte_ids.iter_mut().enumerate() {
            let hex = format!("<0x{b:02X}>");
            *slot = vocab.get(&hex).copied().or_else(|| {
                // llama.cpp falls back to the byte itself as a token.
                let c = char::from_u32(b as u32).filter(char::is_ascii)?;
                vocab.get(c.encode_utf8(&mut [0; 4]) as &str).copied()
            });
        }

        // llama.cpp splits special tokens out longest text first.
        let mut special: Vec<u32> = (0..n)
            .filter(|&i| attrs[i] & attr::SPECIAL != 0 && !texts[i].is_empty())
            .filter_map(|i| u32::try_from(i).ok())
            .collect();
        special.sort_by(|&a, &b| {
            texts[b as usize]
                .len()
                .cmp(&texts[a as usize].len())
                .then(a.cmp(&b))
        });
        let search = if special.is_empty() {
            None
        } else {
            let patterns = special.iter().map(|&id| texts[id as usize].as_str());
            Some(
                AhoCorasick::builder()
                    .match_kind(MatchKind::Standard)
                    .build(patterns)
                    .map_err(|e| TokenizerError::Build(format!("special token search: {e}")))?,
            )
        };
        let rank = (0..special.len())
            .map(|r| u32::try_from(r).unwrap_or(u32::MAX))
            .collect();
        let special_attrs = special.iter().map(|&id| attrs[id as usize]).collect();
        Ok(Spm {
            scores,
            attrs,
            byte_ids,
            unk_id,
            add_space_prefix,
            specials: Specials {
                search,
                ids: special,
                rank,
                attrs: special_attrs,
            },
        })
    }

    pub(crate) fn add_space_prefix(&self) -> bool {
        self.add_space_prefix
    }

    /// Splits the special tokens out of `text` as llama.cpp's
    /// `tokenizer_st_partition` does: token by token, longest text first,
    /// each token's occurrences left to right within what is still text.
    /// With `parse_special` false, control and unknown tokens stay text.
    // Only the tests split without protected ranges.
    #[cfg(test)]
    pub(crate) fn partition(&self, text: &str, parse_special: bool) -> Vec<Fragment> {
        self.partition_protected(text, parse_special, &[])
    }

    /// [`Spm::partition`], except that a control or unknown token whose
    /// text overlaps one of the `protected` byte ranges (sorted, disjoint)
    /// stays text: client text that spells a control token inside a
    /// prompt.
    pub(crate) fn partition_protected(
        &self,
        text: &str,
        parse_special: bool,
        protected: &[Range<usize>],
    ) -> Vec<Fragment> {
        if text.is_empty() {
            return Vec::new();
        }
        let sp = &self.specials;
        let Some(search) = &sp.search else {
            return vec![Fragment::Text(0..text.len())];
        };
        // Every occurrence of every allowed token, in processing order.
        let mut hits: Vec<(u32, usize, usize, usize)> = search
            .find_overlapping_iter(text)
            .filter(|m| {
                sp.attrs[m.pattern().as_usize()] & attr::HIDDEN == 0
                    || (parse_special && !overlaps(protected, m.range()))
            })
            .map(|m| {
                let p = m.pattern().as_usize();
                (sp.rank[p], m.start(), m.end(), p)
            })
            .collect();
        if hits.is_empty() {
            return vec![Fragment::Text(0..text.len())];
        }
        hits.sort_unstable();

        let bytes = text.as_bytes();
        // Text still to be tokenized: start -> end.
        let mut raw: BTreeMap<usize, usize> = BTreeMap::from([(0, text.len())]);
        let mut tokens: Vec<(usize, u32)> = Vec::new();
        for (_, start, end, p) in hits {
            // Accepted only inside one piece of text (not overlapping an
            // earlier token or the whitespace one stripped).
            let Some((&fs, &fe)) = raw.range(..=start).next_back() else {
                continue;
            };
            if end > fe {
                continue;
            }
            raw.remove(&fs);
            let a = sp.attrs[p];
            let mut left_end = start;
            if a & attr::LSTRIP != 0 {
                while left_end > fs && c_isspace(bytes[left_end - 1]) {
                    left_end -= 1;
                }
            }
            let mut right_start = end;
            if a & attr::RSTRIP != 0 {
                while right_start < fe && c_isspace(bytes[right_start]) {
                    right_start += 1;
                }
            }
            if left_end > fs {
                raw.insert(fs, left_end);
            }
            if right_start < fe {
                raw.insert(right_start, fe);
            }
            tokens.push((start, sp.ids[p]));
        }
        let mut out: Vec<(usize, Fragment)> = raw
            .into_iter()
            .map(|(s, e)| (s, Fragment::Text(s..e)))
            .chain(tokens.into_iter().map(|(s, id)| (s, Fragment::Token(id))))
            .collect();
        out.sort_unstable_by_key(|&(s, _)| s);
        out.into_iter().map(|(_, f)| f).collect()
    }

    /// Tokenizes `text` (no BOS/EOS): special tokens split out as
    /// `parse_special` says, then each piece of text by score-driven merges.
    pub(crate) fn encode(
        &self,
        vocab: &HashMap<String, u32>,
        text: &str,
        parse_special: bool,
        out: &mut Vec<u32>,
    ) -> Result<(), TokenizerError> {
        self.encode_protected(vocab, text, parse_special, &[], out)
    }

    /// [`Spm::encode`] over [`Spm::partition_protected`]: the whole text
    /// in one pass, so protected text gets no space prefix of its own
    /// (only the start of `text` and text after a special token do).
    pub(crate) fn encode_protected(
        &self,
        vocab: &HashMap<String, u32>,
        text: &str,
        parse_special: bool,
        protected: &[Range<usize>],
        out: &mut Vec<u32>,
    ) -> Result<(), TokenizerError> {
        // A piece of text after a special token (or at the start) gets
        // the space prefix, as in llama.cpp.
        let mut after_special = true;
        let mut piece = String::new();
        for frag in self.partition_protected(text, parse_special, protected) {
            match frag {
                Fragment::Token(id) => {
                    out.push(id);
                    after_special = true;
                }
                Fragment::Text(range) => {
                    piece.clear();
                    if self.add_space_prefix && after_special {
                        piece.push(SPACE);
                    }
                    for c in text[range].chars() {
                        piece.push(if c == ' ' { SPACE } else { c });
                    }
                    self.merge(vocab, &piece, out)?;
                    after_special = false;
                }
            }
        }
        Ok(())
    }

    /// The token `text` (a merge result) stands for, if it may come out of
    /// plain text: control, unknown and byte tokens never do, so that text
    /// spelling "<eos>" or "<0x41>" stays text.
    fn lookup(&self, vocab: &HashMap<String, u32>, text: &str) -> Option<u32> {
        let id = *vocab.get(text)?;
        let a = *self.attrs.get(id as usize)?;
        (a & (attr::HIDDEN | attr::BYTE) == 0).then_some(id)
    }

    /// Score-driven bigram merging over the characters of `text` (spaces
    /// already escaped), then byte fallback.
    fn merge(
        &self,
        vocab: &HashMap<String, u32>,
        text: &str,
        out: &mut Vec<u32>,
    ) -> Result<(), TokenizerError> {
        let mut symbols: Vec<Symbol> = Vec::with_capacity(text.len());
        for (start, c) in text.char_indices() {
            let i = symbols.len();
            symbols.push(Symbol {
                start,
                len: c.len_utf8(),
                prev: i.checked_sub(1),
                next: Some(i + 1),
            });
        }
        let Some(last) = symbols.last_mut() else {
            return Ok(());
        };
        last.next = None;

        let mut heap = BinaryHeap::with_capacity(symbols.len());
        let try_add = |heap: &mut BinaryHeap<Bigram>, symbols: &[Symbol], l: usize, r: usize| {
            let (sl, sr) = (symbols[l], symbols[r]);
            let size = sl.len + sr.len;
            if let Some(id) = self.lookup(vocab, &text[sl.start..sl.start + size]) {
                heap.push(Bigram {
                    score: self.scores[id as usize],
                    left: l,
                    right: r,
                    size,
                });
            }
        };
        for i in 1..symbols.len() {
            try_add(&mut heap, &symbols, i - 1, i);
        }
        while let Some(b) = heap.pop() {
            let (l, r) = (symbols[b.left], symbols[b.right]);
            if l.len == 0 || r.len == 0 || l.len + r.len != b.size {
                continue; // one side was merged since
            }
            symbols[b.left].len += r.len;
            symbols[b.right].len = 0;
            symbols[b.left].next = r.next;
            if let Some(n) = r.next {
                symbols[n].prev = Some(b.left);
            }
            if let Some(p) = symbols[b.left].prev {
                try_add(&mut heap, &symbols, p, b.left);
            }
            if let Some(n) = symbols[b.left].next {
                try_add(&mut heap, &symbols, b.left, n);
            }
        }

        let mut at = Some(0);
        while let Some(i) = at {
            let s = symbols[i];
            let piece = &text[s.start..s.start + s.len];
            // Every merged symbol is a token; a lone character may not be.
            if let Some(id) = self.lookup(vocab, piece) {
                out.push(id);
            } else {
                let ids: Option<Vec<u32>> =
                    piece.bytes().map(|b| self.byte_ids[b as usize]).collect();
                match (ids, self.unk_id) {
                    (Some(ids), _) => out.extend(ids),
                    // llama.cpp gives up here; SentencePiece's answer.
                    (None, Some(unk)) => out.push(unk),
                    (None, None) => {
                        return Err(TokenizerError::Encode(format!(
                            "{piece:?} is not in the vocabulary, which has neither byte tokens nor an unknown token"
                        )));
                    }
                }
            }
            at = s.next;
        }
        Ok(())
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn model(tokens: &[(&str, f32, u16)], add_space_prefix: bool) -> (Spm, HashMap<String, u32>) {
        let texts: Vec<String> = tokens.iter().map(|t| t.0.to_string()).collect();
        let vocab = texts
            .iter()
            .enumerate()
            .map(|(i, t)| (t.clone(), i as u32))
            .collect();
        let spm = Spm::new(
            &texts,
            tokens.iter().map(|t| t.2).collect(),
            tokens.iter().map(|t| t.1).collect(),
            &vocab,
            Some(0),
            add_space_prefix,
        )
        .unwrap();
        (spm, vocab)
    }

    const N: u16 = attr::NORMAL;

    #[test]
    fn merges_follow_scores_then_position() {
        let (spm, vocab) = model(
            &[
                ("<unk>", 0.0, attr::UNKNOWN),
                ("a", 0.0, N),
                ("b", 0.0, N),
                ("ab", -2.0, N),
                ("bb", -1.0, N),
                ("aa", -3.0, N),
            ],
            false,
        );
        let enc = |t: &str| {
            let mut out = Vec::new();
            spm.encode(&vocab, t, true, &mut out).unwrap();
            out
        };
        // "bb" outscores "ab": a|bb, not ab|b.
        assert_eq!(enc("abb"), vec![1, 4]);
        // Equal scores: the leftmost pair first.
        assert_eq!(enc("aaa"), vec![5, 1]);
        // Unknown character, no byte tokens: the unknown token.
        assert_eq!(enc("ac"), vec![1, 0]);
    }

    #[test]
    fn partition_longest_first_with_strip() {
        let (mut spm, vocab) = model(
            &[
                ("<unk>", 0.0, attr::UNKNOWN),
                ("abc", 0.0, attr::CONTROL),
                ("cdef", 0.0, attr::USER_DEFINED | attr::RSTRIP),
                ("x", 0.0, N),
            ],
            false,
        );
        // The longer token wins even though the shorter one starts first.
        assert_eq!(
            spm.partition("abcdef  x", true),
            vec![
                Fragment::Text(0..2),
                Fragment::Token(2),
                Fragment::Text(8..9)
            ]
        );
        // Control tokens stay text when not parsing special tokens.
        assert_eq!(spm.partition("abcabc", false), vec![Fragment::Text(0..6)]);
        assert_eq!(
            spm.partition("abcabc", true),
            vec![Fragment::Token(1), Fragment::Token(1)]
        );
        spm.add_space_prefix = true;
        let mut out = Vec::new();
        spm.encode(&vocab, "abc x", true, &mut out).unwrap();
        // The space prefix after a special token, then "▁▁x": unknown
        // U+2581 (no byte tokens) twice and x.
        assert_eq!(out, vec![1, 0, 0, 3]);
    }
}
