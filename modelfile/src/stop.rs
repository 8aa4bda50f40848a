//! Stop strings over streamed text.

/// Streams text while watching for stop strings: holds back any tail that
/// could still become a stop string, and cuts the text before a match.
#[derive(Debug, Clone)]
pub struct StopStrings {
    stops: Vec<String>,
    pending: String,
}

impl StopStrings {
    pub fn new(stops: &[String]) -> Self {
        Self {
            stops: stops.iter().filter(|s| !s.is_empty()).cloned().collect(),
            pending: String::new(),
        }
    }

    /// Adds new text; returns the text that is safe to emit and whether a
    /// stop string was found (then nothing more should be generated).
    pub fn push(&mut self, text: &str) -> (String, bool) {
        self.pending.push_str(text);
        if let Some(cut) = self
            .stops
            .iter()
            .filter_map(|s| self.pending.find(s.as_str()))
            .min()
        {
            let emit = self.pending[..cut].to_string();
            self.pending.clear();
            return (emit, true);
        }
        // Keep the longest suffix that is a proper prefix of some stop string.
        let mut keep = 0;
        for s in &self.stops {
            for (i, _) in s.char_indices().skip(1) {
                if i > keep && self.pending.ends_with(&s[..i]) {
                    keep = i;
                }
            }
        }
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
    }
}
