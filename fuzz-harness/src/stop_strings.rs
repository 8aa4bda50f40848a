//! Differential fuzzing of the streaming stop-string matcher against its
//! definition: after each piece, the text before the earliest stop string
//! the text so far contains. The input is split into stop strings and
//! pieces at 0xFF bytes (a separator that UTF-8 never uses).

use tandem_modelfile::stop::StopStrings;

/// One fuzz input.
pub fn run(data: &[u8]) {
    let parts: Vec<String> = data
        .split(|&b| b == 0xFF)
        .map(|p| String::from_utf8_lossy(p).into_owned())
        .collect();
    let (stops, pieces) = parts.split_at(parts.len().min(4) / 2);
    let mut s = StopStrings::new(stops);
    let mut got = String::new();
    let mut hit = false;
    for p in pieces {
        let (emit, h) = s.push(p);
        got.push_str(&emit);
        if h {
            hit = true;
            break;
        }
    }
    if !hit {
        got.push_str(&s.finish(""));
    }
    // The definition.
    let mut text = String::new();
    let mut want = None;
    for p in pieces {
        text.push_str(p);
        if let Some(cut) = stops
            .iter()
            .filter(|s| !s.is_empty())
            .filter_map(|s| text.find(s.as_str()))
            .min()
        {
            want = Some(text[..cut].to_string());
            break;
        }
    }
    assert_eq!(hit, want.is_some());
    assert_eq!(got, want.unwrap_or(text));
}
