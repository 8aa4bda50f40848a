//! Stop strings over streamed text.
//!
//! Each stop string is matched by its own Knuth-Morris-Pratt automaton fed
//! the text once, byte by byte: the cost per token is linear in the new
//! text, whatever the stop strings' lengths (a naive rescan of the held
//! text against every prefix is quadratic in their length).

/// Longest stop string accepted, in bytes (the front end refuses longer).
pub const MAX_STOP_BYTES: usize = 1024;

/// One stop string and how much of it the text now ends with.
#[derive(Debug, Clone)]
struct Matcher {
    pattern: Vec<u8>,
    /// `fail[i]`: length of the longest proper prefix of `pattern[..=i]`
    /// that is also its suffix.
    fail: Vec<usize>,
    /// Bytes of `pattern` the text seen so far ends with.
    state: usize,
}

impl Matcher {
    fn new(pattern: &str) -> Self {
        let p = pattern.as_bytes().to_vec();
        let mut fail = vec![0; p.len()];
        let mut k = 0;
        for i in 1..p.len() {
            while k > 0 && p[i] != p[k] {
                k = fail[k - 1];
            }
            if p[i] == p[k] {
                k += 1;
            }
            fail[i] = k;
        }
        Self {
            pattern: p,
            fail,
            state: 0,
        }
    }

    /// Feeds `text`; the offset just past the first complete match in it.
    fn feed(&mut self, text: &[u8]) -> Option<usize> {
        for (i, &b) in text.iter().enumerate() {
            while self.state > 0 && self.pattern[self.state] != b {
                self.state = self.fail[self.state - 1];
            }
            if self.pattern[self.state] == b {
                self.state += 1;
            }
            if self.state == self.pattern.len() {
                return Some(i + 1);
            }
        }
        None
    }
}

/// Streams text while watching for stop strings: holds back any tail that
/// could still become a stop string, and cuts the text before a match.
#[derive(Debug, Clone)]
pub struct StopStrings {
    matchers: Vec<Matcher>,
    /// Text held back: the longest tail that is a prefix of a stop string.
    pending: String,
}

impl StopStrings {
    pub fn new(stops: &[String]) -> Self {
        Self {
            matchers: stops
                .iter()
                .filter(|s| !s.is_empty())
                .map(|s| Matcher::new(s))
                .collect(),
            pending: String::new(),
        }
    }

    /// Adds new text; returns the text that is safe to emit and whether a
    /// stop string was found (then nothing more should be generated).
    pub fn push(&mut self, text: &str) -> (String, bool) {
        let start = self.pending.len();
        self.pending.push_str(text);
        // The match that begins first wins (several may end in this text).
        let mut cut: Option<usize> = None;
        for m in &mut self.matchers {
            if let Some(end) = m.feed(&self.pending.as_bytes()[start..]) {
                let begin = start + end - m.pattern.len();
                cut = Some(cut.map_or(begin, |c| c.min(begin)));
            }
        }
        if let Some(cut) = cut {
            let emit = self.pending[..cut].to_string();
            self.pending.clear();
            return (emit, true);
        }
        // A matcher's state is a prefix of its (valid UTF-8) pattern, so
        // the held tail starts on a character boundary.
        let keep = self.matchers.iter().map(|m| m.state).max().unwrap_or(0);
        let split = self.pending.len() - keep;
        let emit = self.pending[..split].to_string();
        self.pending.drain(..split);
        (emit, false)
    }

    /// Flushes what was held back (generation ended for another reason).
    pub fn finish(&mut self, tail: &str) -> String {
        let (mut emit, hit) = self.push(tail);
        if !hit {
            emit.push_str(&std::mem::take(&mut self.pending));
        }
        emit
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tandem_types::SeededRng;

    fn run(stops: &[&str], pieces: &[&str]) -> (String, bool) {
        let stops: Vec<String> = stops.iter().map(|s| s.to_string()).collect();
        let mut s = StopStrings::new(&stops);
        let mut out = String::new();
        for p in pieces {
            let (emit, hit) = s.push(p);
            out.push_str(&emit);
            if hit {
                return (out, true);
            }
        }
        out.push_str(&s.finish(""));
        (out, false)
    }

    /// The definition: after each piece, if the text so far contains a
    /// stop string, the text before the earliest one (a stop string is
    /// acted on when it is complete: one that would start earlier but is
    /// not complete yet does not count).
    fn reference(stops: &[&str], pieces: &[&str]) -> (String, bool) {
        let mut text = String::new();
        for p in pieces {
            text.push_str(p);
            if let Some(cut) = stops
                .iter()
                .filter(|s| !s.is_empty())
                .filter_map(|s| text.find(s))
                .min()
            {
                return (text[..cut].to_string(), true);
            }
        }
        (text, false)
    }

    #[test]
    fn stop_string_split_across_pieces_is_cut() {
        assert_eq!(
            run(&["STOP"], &["ab", "cS", "TO", "Pxyz"]),
            ("abc".into(), true)
        );
    }

    #[test]
    fn held_back_prefix_is_released_when_it_diverges() {
        let mut s = StopStrings::new(&["END".to_string()]);
        assert_eq!(s.push("xE"), ("x".into(), false));
        assert_eq!(s.push("Nd"), ("ENd".into(), false));
        assert_eq!(run(&["END"], &["aE", "N"]), ("aEN".into(), false));
    }

    #[test]
    fn earliest_stop_wins_and_multibyte_is_safe() {
        assert_eq!(run(&["é!", "b"], &["aé", "!b"]), ("a".into(), true));
        assert_eq!(run(&["日本"], &["x日", "y"]), ("x日y".into(), false));
        assert_eq!(run(&[], &["a", "b"]), ("ab".into(), false));
        // Self-overlapping patterns (the automaton's fallback).
        assert_eq!(run(&["aab"], &["aa", "aab"]), ("aa".into(), true));
        assert_eq!(run(&["abab"], &["abaab", "ab"]), ("aba".into(), true));
    }

    /// Streamed in random pieces, the result is the definition's, for
    /// random texts and stop strings over a small alphabet (so matches and
    /// near-matches are common).
    #[test]
    fn streaming_agrees_with_the_definition() {
        let mut rng = SeededRng::new(42);
        let alphabet = ['a', 'b', 'é', 'c'];
        let word = |rng: &mut SeededRng, max: usize| -> String {
            (0..1 + rng.below(max))
                .map(|_| alphabet[rng.below(alphabet.len())])
                .collect()
        };
        for _ in 0..2000 {
            let stops: Vec<String> = (0..1 + rng.below(3)).map(|_| word(&mut rng, 4)).collect();
            let text = word(&mut rng, 24);
            // (Pieces are whole characters, as detokenized text is.)
            let chars: Vec<char> = text.chars().collect();
            let mut pieces = Vec::new();
            let mut i = 0;
            while i < chars.len() {
                let n = (1 + rng.below(4)).min(chars.len() - i);
                pieces.push(chars[i..i + n].iter().collect::<String>());
                i += n;
            }
            let stops: Vec<&str> = stops.iter().map(String::as_str).collect();
            let pieces: Vec<&str> = pieces.iter().map(String::as_str).collect();
            assert_eq!(
                run(&stops, &pieces),
                reference(&stops, &pieces),
                "{stops:?} {pieces:?}"
            );
        }
    }

    /// A stop string of a million characters: the text that may still
    /// become it is held, and released when the answer ends.
    #[test]
    fn long_stop_strings_hold_and_release() {
        let long = "ab".repeat(500_000);
        let mut s = StopStrings::new(&[long.clone(), long]);
        for _ in 0..1000 {
            assert_eq!(s.push("ab"), (String::new(), false));
        }
        assert_eq!(s.push("x"), ("ab".repeat(1000) + "x", false));
        assert_eq!(s.finish("a"), "a");
    }
}
