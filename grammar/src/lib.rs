//! Constrained decoding. A request's [`Constraint`] is compiled against the
//! model's vocabulary with llguidance into a [`ConstraintState`], which
//! says before each step which tokens may come next ([`TokenMask`]) and
//! follows the tokens sampled. EOS is allowed exactly when the text so far
//! is complete; once the grammar can only end, EOS is the only choice.

use std::sync::Arc;

mod schema;

pub use schema::close_objects;

use llguidance::api::TopLevelGrammar;
use llguidance::{Matcher, ParserFactory};
use tandem_modelfile::tokenizer::Tokenizer;
use tandem_types::Constraint;
use toktrie::{ApproximateTokEnv, TokEnv, TokRxInfo, TokTrie};

/// A constraint that cannot be used, or a grammar engine failure.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GrammarError {
    /// The constraint itself is invalid or uses what is not supported (the
    /// client's to fix): the message names the problem.
    #[error("invalid constraint: {0}")]
    Invalid(String),
    /// The grammar engine failed on a token (ours).
    #[error("grammar engine: {0}")]
    Engine(String),
}

/// Compiles constraints for one vocabulary. Build it once per model.
#[derive(Clone)]
pub struct GrammarCompiler {
    factory: Arc<ParserFactory>,
    vocab_size: usize,
}

impl std::fmt::Debug for GrammarCompiler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrammarCompiler")
            .field("vocab_size", &self.vocab_size)
            .finish()
    }
}

impl GrammarCompiler {
    /// Indexes `tok`'s vocabulary: every token's bytes, control tokens
    /// marked so that no text can produce them.
    pub fn new(tok: &Tokenizer) -> Result<Self, GrammarError> {
        let n = tok.vocab_size();
        let words: Vec<Vec<u8>> = (0..n as u32)
            .map(|id| {
                let bytes = tok.token_to_piece_bytes(id).unwrap_or_default();
                if tok.is_special(id) {
                    let mut w = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                    w.extend(bytes);
                    w
                } else {
                    bytes
                }
            })
            .collect();
        let eos = tok.eos_id().or(tok.eot_id()).unwrap_or(0);
        let mut info = TokRxInfo::new(n as u32, eos);
        info.tok_bos = tok.bos_id();
        info.tok_end_of_turn = tok.eot_id();
        let trie = TokTrie::from(&info, &words);
        // Tokenization inside the engine only heals forced byte runs; the
        // trie's greedy tokenizer is enough for that.
        let env: TokEnv = Arc::new(ApproximateTokEnv::new(trie));
        let mut factory = ParserFactory::new_simple(&env).map_err(engine)?;
        // Errors are returned to the caller, not printed by the library.
        factory.set_stderr_log_level(0);
        Ok(Self {
            factory: Arc::new(factory),
            vocab_size: n,
        })
    }

    /// Compiles `c`; an invalid or unsupported constraint is
    /// [`GrammarError::Invalid`] naming the problem.
    pub fn compile(&self, c: &Constraint) -> Result<ConstraintState, GrammarError> {
        let grammar = match c {
            Constraint::JsonSchema(text) => {
                let schema: serde_json::Value = serde_json::from_str(text)
                    .map_err(|e| GrammarError::Invalid(format!("schema is not JSON: {e}")))?;
                TopLevelGrammar::from_json_schema(compact(schema))
            }
            Constraint::JsonObject => {
                TopLevelGrammar::from_json_schema(compact(serde_json::json!({"type": "object"})))
            }
            Constraint::Regex(rx) => TopLevelGrammar::from_regex(rx),
            Constraint::Lark(src) => TopLevelGrammar::from_lark(src.clone()),
        };
        let parser = self
            .factory
            .create_parser(grammar)
            .map_err(|e| GrammarError::Invalid(e.to_string()))?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(GrammarError::Invalid(e));
        }
        Ok(ConstraintState {
            matcher,
            vocab_size: self.vocab_size,
        })
    }
}

/// JSON without whitespace between tokens (unless the schema's
/// `x-guidance` options say otherwise): with free whitespace a small model
/// at temperature 1 can spend its whole budget on newlines.
fn compact(mut schema: serde_json::Value) -> serde_json::Value {
    if let Some(o) = schema.as_object_mut() {
        o.entry("x-guidance")
            .or_insert_with(|| serde_json::json!({"whitespace_flexible": false}));
    }
    schema
}

fn engine(e: impl std::fmt::Display) -> GrammarError {
    GrammarError::Engine(e.to_string())
}

/// One sequence's position in its grammar.
pub struct ConstraintState {
    matcher: Matcher,
    vocab_size: usize,
}

impl std::fmt::Debug for ConstraintState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConstraintState")
            .field("stopped", &self.matcher.is_stopped())
            .finish()
    }
}

impl ConstraintState {
    /// The tokens allowed next (only EOS once the grammar has ended).
    pub fn mask(&mut self) -> Result<TokenMask, GrammarError> {
        let v = self.matcher.compute_mask_or_eos().map_err(engine)?;
        Ok(TokenMask {
            bits: v.as_slice().to_vec(),
            vocab_size: self.vocab_size,
        })
    }

    /// Advances past a sampled token. Once the grammar has ended (its only
    /// continuation is EOS), the EOS that ends the request is not consumed.
    pub fn consume(&mut self, token: u32) -> Result<(), GrammarError> {
        if self.matcher.is_stopped() {
            return Ok(());
        }
        self.matcher.consume_token(token).map_err(engine)
    }

    /// Whether the grammar allows nothing but the end.
    pub fn is_finished(&self) -> bool {
        self.matcher.is_stopped()
    }
}

/// A set of allowed token ids.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenMask {
    /// Bit `i % 32` of word `i / 32` is set when token `i` is allowed.
    bits: Vec<u32>,
    vocab_size: usize,
}

impl TokenMask {
    pub fn allows(&self, token: u32) -> bool {
        let i = token as usize;
        i < self.vocab_size
            && self
                .bits
                .get(i / 32)
                .is_some_and(|w| w & (1 << (i % 32)) != 0)
    }

    /// Sets every disallowed logit to minus infinity. Logits past the
    /// vocabulary (padding) are always disallowed.
    pub fn apply(&self, logits: &mut [f32]) {
        for (i, l) in logits.iter_mut().enumerate() {
            if !self.allows(i as u32) {
                *l = f32::NEG_INFINITY;
            }
        }
    }

    pub fn count(&self) -> usize {
        (0..self.vocab_size as u32)
            .filter(|&t| self.allows(t))
            .count()
    }
}
