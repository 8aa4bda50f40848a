//! The requests' contents: seeded random prompts of common words, shared
//! prefixes, and the user messages of multi-turn sessions.

use tandem_types::SeededRng;

use super::args::BenchArgs;

/// Short, common words: about one token each (with the leading space) for
/// byte-level BPE tokenizers.
const WORDS: &[&str] = &[
    "the", "of", "and", "to", "in", "is", "was", "that", "for", "on", "with", "as", "by", "at",
    "from", "his", "her", "an", "are", "not", "be", "or", "had", "this", "one", "all", "but",
    "they", "which", "were", "there", "been", "has", "more", "new", "who", "can", "time", "some",
    "other", "when", "first", "two", "into", "city", "year", "school", "world", "house", "water",
    "light", "music", "river", "game", "book", "story", "night", "road", "small", "large", "old",
    "young", "long", "high", "great", "good", "last", "own", "war", "work", "life", "day", "way",
    "man", "state", "team", "film", "name", "part", "place", "point", "hand", "home", "side",
    "end", "family", "group", "power", "line", "head", "land", "early", "late", "red", "blue",
    "green", "black", "white", "king", "church", "army", "party", "club", "town", "car", "ship",
    "train", "field", "tree", "fire", "stone", "song", "law", "art", "food", "money", "market",
];

/// Appends `n` random words of `WORDS`, space-separated.
fn words(rng: &mut SeededRng, n: usize, out: &mut String) {
    for _ in 0..n {
        if !out.is_empty() {
            out.push(' ');
        }
        out.push_str(WORDS[rng.below(WORDS.len())]);
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Role {
    User,
    Assistant,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Msg {
    pub(super) role: Role,
    pub(super) content: String,
}

#[derive(Debug, Clone, Default)]
pub(super) struct Spec {
    /// The prompt, or in a chat the new user message.
    pub(super) prompt: String,
    /// Estimated prompt tokens (words), history included.
    pub(super) input_words: usize,
    pub(super) max_tokens: usize,
    /// Earlier messages of a multi-turn session.
    pub(super) history: Vec<Msg>,
    /// 1-based turn of a multi-turn session; 0 for single requests.
    pub(super) turn: usize,
    /// KV tokens the previous turn could have left for this one.
    pub(super) carryable: Option<u64>,
}

fn shared_prefixes(args: &BenchArgs, rng: &mut SeededRng) -> Vec<String> {
    let groups = if args.shared_prefix_len > 0 {
        args.shared_prefix_groups
    } else {
        0
    };
    (0..groups)
        .map(|_| {
            let mut s = String::new();
            words(rng, args.shared_prefix_len, &mut s);
            s
        })
        .collect()
}

/// One random prompt (or user message), optionally after a shared prefix.
fn draw(args: &BenchArgs, rng: &mut SeededRng, prefix: Option<&str>) -> Spec {
    let input = match args.input_len_range {
        Some((lo, hi)) => rng.range(lo, hi),
        None => args.input_len.max(1),
    };
    let max_tokens = match args.output_len_range {
        Some((lo, hi)) => rng.range(lo, hi),
        None => args.output_len.max(1),
    };
    let mut prompt = String::new();
    let mut new_words = input;
    let mut input_words = input;
    if let Some(p) = prefix {
        prompt.push_str(p);
        new_words = input.saturating_sub(args.shared_prefix_len).max(1);
        input_words = args.shared_prefix_len + new_words;
    }
    words(rng, new_words, &mut prompt);
    Spec {
        prompt,
        input_words,
        max_tokens,
        ..Spec::default()
    }
}

pub(super) fn make_specs(args: &BenchArgs) -> Vec<Spec> {
    let mut rng = SeededRng::new(args.seed);
    let prefixes = shared_prefixes(args, &mut rng);
    (0..args.num_requests)
        .map(|i| {
            let prefix = (!prefixes.is_empty()).then(|| prefixes[i % prefixes.len()].as_str());
            draw(args, &mut rng, prefix)
        })
        .collect()
}

/// The user messages of `sessions` sessions of `turns` turns (session i's
/// first message starts with shared prefix i % G). `point` salts the seed so
/// each sweep point gets fresh conversations: replaying the same ones would
/// find the previous point's blocks still cached and overstate retention.
pub(super) fn make_sessions(
    args: &BenchArgs,
    sessions: usize,
    turns: usize,
    point: usize,
) -> Vec<Vec<Spec>> {
    let mut rng = SeededRng::new(args.seed ^ (point as u64).wrapping_mul(0xD1B5_4A32_D192_ED03));
    let prefixes = shared_prefixes(args, &mut rng);
    (0..sessions)
        .map(|i| {
            (0..turns)
                .map(|k| {
                    let prefix = (k == 0 && !prefixes.is_empty())
                        .then(|| prefixes[i % prefixes.len()].as_str());
                    draw(args, &mut rng, prefix)
                })
                .collect()
        })
        .collect()
}
