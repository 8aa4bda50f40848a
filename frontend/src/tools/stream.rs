//! Tool calls out of an answer as it streams. Content before a call flows
//! on; a Hermes call (`<tool_call>{"name": ..., "arguments": ...}`) is
//! announced as soon as its function is known (at once when `tool_choice`
//! names it) and its arguments follow as they are generated, as OpenAI
//! streams them. A call that never ends (cut by `max_tokens`) is still a
//! call, with the arguments written so far; never raw markup in content.

use serde_json::Value;

use super::{ParsedCall, ToolParser, call_of};

/// What the grammar forces (`tool_choice`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Forced {
    /// Nothing: the model decides (`auto`).
    No,
    /// Calls only, of any tool (`required`).
    Any,
    /// Calls of this function only.
    Named(String),
}

/// A streamed piece of a call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CallDelta {
    /// Call `index` (of this answer) of function `name` begins.
    Start { index: usize, name: String },
    /// More of call `index`'s arguments text.
    Arguments { index: usize, text: String },
}

/// What a push or the end makes sendable.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Pushed {
    pub content: String,
    pub calls: Vec<CallDelta>,
}

const OPEN: &str = "<tool_call>";
const CLOSE: &str = "</tool_call>";

/// Streams an answer's content and its tool calls (see the module doc).
/// Llama 3 JSON calls are held from their `{` and parsed at the end.
#[derive(Debug)]
pub struct ToolStream {
    parser: ToolParser,
    forced: Forced,
    /// Text not yet resolved: a possible marker prefix or blank text after
    /// a call, the open call's body, or (Llama 3) the held call.
    held: String,
    /// The open call (Hermes), or the held answer (Llama 3).
    open: Option<OpenCall>,
    /// Calls finished so far.
    calls: Vec<ParsedCall>,
    /// Whether any non-blank content went out (a Llama 3 call must be the
    /// whole answer).
    started: bool,
}

impl ToolStream {
    pub fn new(parser: ToolParser, forced: Forced) -> Self {
        Self {
            parser,
            forced,
            held: String::new(),
            open: None,
            calls: Vec::new(),
            started: false,
        }
    }

    /// Adds text; returns the content and call pieces that can be sent now.
    pub fn push(&mut self, text: &str) -> Pushed {
        self.held.push_str(text);
        let mut out = Pushed::default();
        match self.parser {
            ToolParser::Llama3Json => out.content = self.push_llama3(),
            ToolParser::Hermes | ToolParser::None => self.push_hermes(&mut out),
        }
        self.started |= !out.content.trim().is_empty();
        out
    }

    /// Ends the answer: what was held, and every call of the answer.
    pub fn finish(&mut self) -> (Pushed, Vec<ParsedCall>) {
        let mut out = Pushed::default();
        let held = std::mem::take(&mut self.held);
        match (self.parser, self.open.take()) {
            (ToolParser::Llama3Json, Some(_)) => {
                let (content, calls) = self.parser.extract(&held);
                if calls.is_empty() && self.forced != Forced::No {
                    // Cut short: whatever call it began.
                    let mut call = OpenCall::new(&self.forced, 0, "parameters");
                    call.scan(&held);
                    if let Some(c) = call.partial(&held) {
                        self.calls.push(c);
                    }
                } else {
                    out.content = content;
                    self.calls = calls;
                }
                for (index, c) in self.calls.iter().enumerate() {
                    out.calls.push(CallDelta::Start {
                        index,
                        name: c.name.clone(),
                    });
                    out.calls.push(CallDelta::Arguments {
                        index,
                        text: c.arguments.clone(),
                    });
                }
            }
            (_, Some(mut call)) => {
                // No closing tag: the answer ended inside the call.
                let body = super::strip_partial(&held, CLOSE);
                call.scan(body);
                self.close(call, body, false, &mut out);
            }
            (_, None) => {
                if self.forced == Forced::No && (self.calls.is_empty() || !held.trim().is_empty()) {
                    out.content = held;
                }
            }
        }
        (out, std::mem::take(&mut self.calls))
    }

    fn push_llama3(&mut self) -> String {
        if self.open.is_some() {
            return String::new();
        }
        let t = self.held.trim_start();
        if self.started || !(t.is_empty() || t.starts_with('{')) {
            return std::mem::take(&mut self.held);
        }
        if t.starts_with('{') {
            // Only blanks before it: held with the call.
            self.open = Some(OpenCall::new(&self.forced, 0, "parameters"));
        }
        String::new()
    }

    fn push_hermes(&mut self, out: &mut Pushed) {
        loop {
            if let Some(mut call) = self.open.take() {
                match self.held.find(CLOSE) {
                    Some(end) => {
                        let body = self.held[..end].to_string();
                        self.held.drain(..end + CLOSE.len());
                        call.scan(&body);
                        self.close(call, &body, true, out);
                    }
                    None => {
                        call.scan(&self.held);
                        call.stream(&self.held, out);
                        self.open = Some(call);
                        return;
                    }
                }
            } else if let Some(at) = self.held.find(OPEN) {
                let before: String = self.held.drain(..at + OPEN.len()).collect();
                self.content(&before[..at], out);
                let call = OpenCall::new(&self.forced, self.calls.len(), "arguments");
                if let Some(name) = &call.name {
                    out.calls.push(CallDelta::Start {
                        index: call.index,
                        name: name.clone(),
                    });
                }
                self.open = Some(call);
            } else {
                // Keep a tail that could still become the marker, and blank
                // text after a call (dropped unless content follows).
                let keep = (1..OPEN.len())
                    .rev()
                    .find(|&n| self.held.ends_with(&OPEN[..n]))
                    .unwrap_or(0);
                let split = self.held.len() - keep;
                if self.calls.is_empty() || !self.held[..split].trim().is_empty() {
                    let text: String = self.held.drain(..split).collect();
                    self.content(&text, out);
                }
                return;
            }
        }
    }

    /// Content outside calls: none when the grammar forces calls, and no
    /// blank text between or after calls.
    fn content(&self, text: &str, out: &mut Pushed) {
        let blank_by_calls = !self.calls.is_empty() && text.trim().is_empty();
        if self.forced == Forced::No && !blank_by_calls {
            out.content.push_str(text);
        }
    }

    /// Ends `call` whose whole body is `body` (`closed`: by its tag).
    fn close(&mut self, mut call: OpenCall, body: &str, closed: bool, out: &mut Pushed) {
        let whole = serde_json::from_str::<Value>(body.trim())
            .ok()
            .and_then(|v| call_of(&v, call.args_key));
        let parsed = match whole {
            Some(c) if call.name.as_ref().is_none_or(|n| *n == c.name) => Some(c),
            _ => call.partial(body),
        };
        let Some(parsed) = parsed else {
            // Not a call after all (the model wrote the tag in prose).
            if self.forced == Forced::No {
                out.content.push_str(OPEN);
                out.content.push_str(body);
                if closed {
                    out.content.push_str(CLOSE);
                }
            }
            return;
        };
        if !call.started {
            out.calls.push(CallDelta::Start {
                index: call.index,
                name: parsed.name.clone(),
            });
            call.started = true;
        }
        if call.sent == 0 && !call.streaming() {
            // Nothing streamed: the arguments in one piece.
            out.calls.push(CallDelta::Arguments {
                index: call.index,
                text: parsed.arguments.clone(),
            });
        } else {
            call.stream(body, out);
        }
        self.calls.push(parsed);
    }
}

/// A call being read: `{"name": "...", "<args_key>": <arguments>}` in that
/// order, as templates and the forced grammar write it.
#[derive(Debug)]
struct OpenCall {
    index: usize,
    args_key: &'static str,
    /// Known from the grammar or read from the body.
    name: Option<String>,
    /// Whether its `Start` went out.
    started: bool,
    /// Where the arguments begin in the body, once read that far.
    args_at: Option<usize>,
    /// The body does not follow the expected order: parsed at its end.
    mismatch: bool,
    /// Bytes of the arguments sent.
    sent: usize,
    /// Bytes of the body scanned by `json`.
    scanned: usize,
    json: JsonScan,
}

impl OpenCall {
    fn new(forced: &Forced, index: usize, args_key: &'static str) -> Self {
        let name = match forced {
            Forced::Named(n) => Some(n.clone()),
            Forced::No | Forced::Any => None,
        };
        Self {
            index,
            args_key,
            started: name.is_some(),
            name,
            args_at: None,
            mismatch: false,
            sent: 0,
            scanned: 0,
            json: JsonScan::default(),
        }
    }

    /// Whether the arguments are being streamed as they come.
    fn streaming(&self) -> bool {
        self.args_at.is_some() && !self.mismatch && !self.json.not_streamable
    }

    /// Reads the body so far: the name, then the arguments' extent.
    fn scan(&mut self, body: &str) {
        if self.mismatch {
            return;
        }
        if self.args_at.is_none() {
            match read_head(body, self.args_key) {
                Head::Incomplete => return,
                Head::Mismatch => {
                    self.mismatch = true;
                    return;
                }
                Head::Name(name) => {
                    self.name.get_or_insert(name);
                    return;
                }
                Head::Arguments(name, at) => {
                    self.name.get_or_insert(name);
                    self.args_at = Some(at);
                    self.scanned = at;
                }
            }
        }
        if body.len() > self.scanned {
            self.json.feed(&body.as_bytes()[self.scanned..]);
            self.scanned = body.len();
        }
    }

    /// Sends what can be sent of the call: its start, then the arguments
    /// scanned so far (up to their end).
    fn stream(&mut self, body: &str, out: &mut Pushed) {
        if let (false, Some(name)) = (self.started, &self.name) {
            out.calls.push(CallDelta::Start {
                index: self.index,
                name: name.clone(),
            });
            self.started = true;
        }
        let Some(at) = self.args_at.filter(|_| self.streaming()) else {
            return;
        };
        let end = self.json.end.unwrap_or(self.json.fed).min(body.len() - at);
        if end > self.sent
            && let Some(text) = body.get(at + self.sent..at + end)
        {
            out.calls.push(CallDelta::Arguments {
                index: self.index,
                text: text.to_string(),
            });
            self.sent = end;
        }
    }

    /// The call as far as it was written (its JSON unfinished), if its
    /// function is known.
    fn partial(&self, body: &str) -> Option<ParsedCall> {
        let name = self.name.clone()?;
        let arguments = match self.args_at {
            Some(at) if !self.mismatch => {
                let end = self.json.end.unwrap_or(body.len() - at);
                body.get(at..at + end).unwrap_or_default().to_string()
            }
            _ => String::new(),
        };
        Some(ParsedCall { name, arguments })
    }
}

/// How far a call body's head (`{"name": "f", "arguments": `) is written.
#[derive(Debug, PartialEq, Eq)]
enum Head {
    Incomplete,
    Mismatch,
    /// The name is read; the arguments key is not yet.
    Name(String),
    /// The name, and where the arguments value begins.
    Arguments(String, usize),
}

fn read_head(body: &str, args_key: &str) -> Head {
    let mut c = Cursor { s: body, at: 0 };
    for want in ["{", "\"name\"", ":", "\""] {
        match c.token(want) {
            Step::Ok => {}
            Step::More => return Head::Incomplete,
            Step::No => return Head::Mismatch,
        }
    }
    let start = c.at - 1;
    let Some(len) = string_end(&body.as_bytes()[c.at..]) else {
        return Head::Incomplete;
    };
    let Ok(name) = serde_json::from_str::<String>(&body[start..c.at + len]) else {
        return Head::Mismatch;
    };
    c.at += len;
    let key = format!("\"{args_key}\"");
    for want in [",", key.as_str(), ":"] {
        match c.token(want) {
            Step::Ok => {}
            Step::More => return Head::Name(name),
            Step::No => return Head::Mismatch,
        }
    }
    c.skip_blank();
    if c.at == body.len() {
        return Head::Name(name);
    }
    Head::Arguments(name, c.at)
}

enum Step {
    Ok,
    More,
    No,
}

struct Cursor<'a> {
    s: &'a str,
    at: usize,
}

impl Cursor<'_> {
    fn skip_blank(&mut self) {
        let rest = &self.s[self.at..];
        self.at += rest.len() - rest.trim_start().len();
    }

    /// `want` after optional blanks.
    fn token(&mut self, want: &str) -> Step {
        self.skip_blank();
        let rest = &self.s[self.at..];
        if rest.starts_with(want) {
            self.at += want.len();
            Step::Ok
        } else if want.starts_with(rest) {
            Step::More
        } else {
            Step::No
        }
    }
}

/// Length through the closing quote of a JSON string whose opening quote
/// came before `s`; `None` while it is open.
fn string_end(s: &[u8]) -> Option<usize> {
    let mut escaped = false;
    for (i, &b) in s.iter().enumerate() {
        match (escaped, b) {
            (true, _) => escaped = false,
            (false, b'\\') => escaped = true,
            (false, b'"') => return Some(i + 1),
            _ => {}
        }
    }
    None
}

/// Where a JSON object or array value ends, fed a byte at a time.
#[derive(Debug, Default)]
struct JsonScan {
    depth: usize,
    in_string: bool,
    escaped: bool,
    /// Bytes fed (blanks before the value included).
    fed: usize,
    /// Length of the value with what precedes it, once it closed.
    end: Option<usize>,
    /// The value is not an object or array (e.g. arguments as a string):
    /// it is sent whole at the end.
    not_streamable: bool,
}

impl JsonScan {
    fn feed(&mut self, bytes: &[u8]) {
        for &b in bytes {
            if self.end.is_some() || self.not_streamable {
                return;
            }
            self.fed += 1;
            if self.in_string {
                match (self.escaped, b) {
                    (true, _) => self.escaped = false,
                    (false, b'\\') => self.escaped = true,
                    (false, b'"') => self.in_string = false,
                    _ => {}
                }
                continue;
            }
            match b {
                b'"' if self.depth > 0 => self.in_string = true,
                b'{' | b'[' => self.depth += 1,
                b'}' | b']' if self.depth > 0 => {
                    self.depth -= 1;
                    if self.depth == 0 {
                        self.end = Some(self.fed);
                    }
                }
                b' ' | b'\t' | b'\n' | b'\r' if self.depth == 0 => {}
                _ if self.depth == 0 => self.not_streamable = true,
                _ => {}
            }
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    /// `pieces` pushed then finished: the content, the deltas, the calls.
    fn run(
        p: ToolParser,
        forced: Forced,
        pieces: &[&str],
    ) -> (String, Vec<CallDelta>, Vec<ParsedCall>) {
        let mut ts = ToolStream::new(p, forced);
        let mut content = String::new();
        let mut deltas = Vec::new();
        for x in pieces {
            let out = ts.push(x);
            content.push_str(&out.content);
            deltas.extend(out.calls);
        }
        let (out, calls) = ts.finish();
        content.push_str(&out.content);
        deltas.extend(out.calls);
        (content, deltas, calls)
    }

    /// The streamed deltas of call `index`: its name and its arguments.
    fn assembled(deltas: &[CallDelta], index: usize) -> (String, String) {
        let mut name = String::new();
        let mut args = String::new();
        for d in deltas {
            match d {
                CallDelta::Start { index: i, name: n } if *i == index => {
                    assert!(name.is_empty(), "two starts for call {index}: {deltas:?}");
                    name = n.clone();
                }
                CallDelta::Arguments { index: i, text } if *i == index => {
                    assert!(!name.is_empty(), "arguments before the start: {deltas:?}");
                    args.push_str(text);
                }
                _ => {}
            }
        }
        (name, args)
    }

    fn chars(s: &str) -> Vec<String> {
        s.chars().map(String::from).collect()
    }

    #[test]
    fn streamed_content_stops_at_a_call_split_anywhere() {
        let text = "Sure.<tool_call>{\"name\": \"f\", \"arguments\": {\"a\": 1}}</tool_call>";
        for cut in 1..text.len() {
            let (a, b) = text.split_at(cut);
            let (content, deltas, calls) = run(ToolParser::Hermes, Forced::No, &[a, b]);
            assert_eq!(content, "Sure.", "cut {cut}");
            assert_eq!(calls.len(), 1, "cut {cut}");
            assert_eq!(calls[0].arguments, r#"{"a":1}"#, "cut {cut}");
            let (name, args) = assembled(&deltas, 0);
            assert_eq!(name, "f", "cut {cut}");
            assert_eq!(args, r#"{"a": 1}"#, "cut {cut}");
        }
        // A partial marker that diverges is content.
        assert_eq!(
            run(ToolParser::Hermes, Forced::No, &["a <tool", "box>"]).0,
            "a <toolbox>"
        );
        let (content, _, calls) = run(
            ToolParser::Llama3Json,
            Forced::No,
            &["  ", "{\"name\": \"f\", ", "\"parameters\": {}}"],
        );
        assert_eq!((content.as_str(), calls.len()), ("", 1));
        assert_eq!(
            run(ToolParser::Llama3Json, Forced::No, &["Hi {x}"]).0,
            "Hi {x}"
        );
    }

    #[test]
    fn the_name_goes_out_first_and_arguments_as_they_come() {
        let text = "<tool_call>\n{\"name\":\"get_weather\",\"arguments\":{\"city\":\"Paris\",\"days\":[1,2]}}\n</tool_call>";
        let mut ts = ToolStream::new(ToolParser::Hermes, Forced::Any);
        let mut deltas = Vec::new();
        let mut when_named = None;
        for (i, c) in chars(text).iter().enumerate() {
            let out = ts.push(c);
            assert_eq!(out.content, "");
            if when_named.is_none() && !out.calls.is_empty() {
                when_named = Some(i);
            }
            deltas.extend(out.calls);
        }
        // The name went out once its string closed, before any argument.
        assert_eq!(when_named, text.find("get_weather\"").map(|i| i + 11));
        let args_pieces = deltas
            .iter()
            .filter(|d| matches!(d, CallDelta::Arguments { .. }))
            .count();
        assert!(args_pieces > 10, "{deltas:?}");
        let (out, calls) = ts.finish();
        assert_eq!(out, Pushed::default());
        assert_eq!(
            assembled(&deltas, 0),
            (
                "get_weather".into(),
                r#"{"city":"Paris","days":[1,2]}"#.into()
            )
        );
        assert_eq!(calls[0].arguments, r#"{"city":"Paris","days":[1,2]}"#);
    }

    #[test]
    fn a_named_call_starts_at_once_and_a_cut_call_is_kept() {
        let forced = Forced::Named("get_time".into());
        let mut ts = ToolStream::new(ToolParser::Hermes, forced.clone());
        let first = ts.push("<tool_call>");
        assert_eq!(
            first.calls,
            [CallDelta::Start {
                index: 0,
                name: "get_time".into()
            }]
        );
        // Cut by max_tokens inside the arguments.
        let (content, deltas, calls) = run(
            ToolParser::Hermes,
            forced.clone(),
            &[
                "<tool_call>\n{\"name\":\"get_time\",\"argu",
                "ments\":{\"tz\":\"UT",
            ],
        );
        assert_eq!(content, "");
        assert_eq!(
            calls,
            [ParsedCall {
                name: "get_time".into(),
                arguments: r#"{"tz":"UT"#.into()
            }]
        );
        assert_eq!(
            assembled(&deltas, 0),
            ("get_time".into(), r#"{"tz":"UT"#.into())
        );
        // Cut before the arguments: the call, with none.
        let (content, deltas, calls) = run(ToolParser::Hermes, forced, &["<tool_call>\n{\"na"]);
        assert_eq!(content, "");
        assert_eq!(calls[0].name, "get_time");
        assert_eq!(calls[0].arguments, "");
        assert_eq!(assembled(&deltas, 0).0, "get_time");
        // `required`: a call cut once its name is read is kept; one cut
        // before that is no call, and no content either.
        let (_, _, calls) = run(
            ToolParser::Hermes,
            Forced::Any,
            &["<tool_call>\n{\"name\":\"f\",\"arguments\":{\"x\":"],
        );
        assert_eq!(
            (calls[0].name.as_str(), calls[0].arguments.as_str()),
            ("f", r#"{"x":"#)
        );
        let (content, deltas, calls) = run(
            ToolParser::Hermes,
            Forced::Any,
            &["<tool_call>\n{\"name\":\"f"],
        );
        assert_eq!((content.as_str(), deltas.len(), calls.len()), ("", 0, 0));
    }

    #[test]
    fn parallel_calls_are_indexed_and_blank_between_them_dropped() {
        let text = "<tool_call>\n{\"name\": \"w\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"w\", \"arguments\": {\"city\": \"Oslo\"}}\n</tool_call>\n";
        for forced in [Forced::No, Forced::Any] {
            let (content, deltas, calls) = run(
                ToolParser::Hermes,
                forced.clone(),
                &chars(text).iter().map(String::as_str).collect::<Vec<_>>(),
            );
            assert_eq!(content, "", "{forced:?}");
            assert_eq!(calls.len(), 2, "{forced:?}");
            assert_eq!(
                assembled(&deltas, 0),
                ("w".into(), r#"{"city": "Paris"}"#.into())
            );
            assert_eq!(
                assembled(&deltas, 1),
                ("w".into(), r#"{"city": "Oslo"}"#.into())
            );
        }
    }

    #[test]
    fn calls_in_another_order_or_not_calls_at_all() {
        // Arguments before the name: sent whole when the call ends.
        let (_, deltas, calls) = run(
            ToolParser::Hermes,
            Forced::No,
            &["<tool_call>{\"arguments\": {\"a\": 1}, \"name\": \"f\"}</tool_call>"],
        );
        assert_eq!(calls[0].name, "f");
        assert_eq!(assembled(&deltas, 0), ("f".into(), r#"{"a":1}"#.into()));
        // Arguments as a JSON string: sent whole, decoded.
        let (_, deltas, calls) = run(
            ToolParser::Hermes,
            Forced::No,
            &["<tool_call>{\"name\": \"f\", \"arguments\": \"{\\\"a\\\": 1}\"}</tool_call>"],
        );
        assert_eq!(calls[0].arguments, r#"{"a": 1}"#);
        assert_eq!(assembled(&deltas, 0).1, r#"{"a": 1}"#);
        // Not JSON: prose, as it was written.
        let (content, deltas, calls) = run(
            ToolParser::Hermes,
            Forced::No,
            &["a <tool_call>oops</tool_call> b"],
        );
        assert_eq!(content, "a <tool_call>oops</tool_call> b");
        assert!(deltas.is_empty() && calls.is_empty());
        // Content after a call is content.
        let (content, _, calls) = run(
            ToolParser::Hermes,
            Forced::No,
            &["<tool_call>{\"name\": \"f\", \"arguments\": {}}</tool_call>\nDone."],
        );
        assert_eq!((content.as_str(), calls.len()), ("\nDone.", 1));
    }

    #[test]
    fn a_forced_llama3_call_cut_short_is_kept() {
        let (content, deltas, calls) = run(
            ToolParser::Llama3Json,
            Forced::Named("f".into()),
            &["{\"name\": \"f\", \"parameters\": {\"x\": \"ab"],
        );
        assert_eq!(content, "");
        assert_eq!(
            (calls[0].name.as_str(), calls[0].arguments.as_str()),
            ("f", r#"{"x": "ab"#)
        );
        assert_eq!(assembled(&deltas, 0).0, "f");
    }
}
