//! Closing a JSON schema's objects: OpenAI's strict mode (and what a tool's
//! parameters mean) is "these keys and no others", while JSON Schema, which
//! llguidance follows, lets an object hold any key its schema does not
//! forbid. [`close_objects`] makes every object schema that does not say
//! otherwise forbid additional properties.

use serde_json::{Map, Value};

/// Keywords whose value is one subschema.
const ONE: &[&str] = &[
    "items",
    "additionalItems",
    "contains",
    "not",
    "if",
    "then",
    "else",
];

/// Keywords whose value is a list of subschemas.
const LIST: &[&str] = &["anyOf", "oneOf", "prefixItems"];

/// Keywords whose value maps names to subschemas.
const MAP: &[&str] = &["properties", "patternProperties", "$defs", "definitions"];

/// Adds `"additionalProperties": false` to every object schema in `schema`
/// (at any depth: properties, items, `anyOf` alternatives, `$defs`, ...)
/// that does not set `additionalProperties` or `unevaluatedProperties`
/// itself: a schema that opens an object (`true`, or a schema for the
/// extra values) keeps it open.
///
/// Left open: the parts of an `allOf`, and an object schema that is also
/// combined with `allOf`, `anyOf`, `oneOf` or a `$ref`. Their properties are
/// spread over several schemas, each of which would forbid the others'
/// keys if closed on its own; the objects nested inside them are closed.
pub fn close_objects(schema: &mut Value) {
    let Value::Object(o) = schema else { return };
    if is_object_schema(o) && !is_combined(o) && !opens_itself(o) {
        o.insert("additionalProperties".into(), Value::Bool(false));
    }
    for (key, sub) in o.iter_mut() {
        let key = key.as_str();
        if key == "additionalProperties" || ONE.contains(&key) {
            close_objects(sub);
        } else if LIST.contains(&key) {
            for s in sub.as_array_mut().into_iter().flatten() {
                close_objects(s);
            }
        } else if key == "allOf" {
            for s in sub.as_array_mut().into_iter().flatten() {
                close_inside(s);
            }
        } else if MAP.contains(&key) {
            for s in sub.as_object_mut().into_iter().flat_map(|m| m.values_mut()) {
                close_objects(s);
            }
        }
    }
}

/// Closes what `schema` nests, but not `schema` itself (an `allOf` part).
fn close_inside(schema: &mut Value) {
    let Value::Object(o) = schema else { return };
    let keep = !opens_itself(o);
    close_objects(schema);
    if keep && let Value::Object(o) = schema {
        o.remove("additionalProperties");
    }
}

/// Whether `o` describes objects: `"type": "object"` (alone or in a list
/// of types) or object keywords.
fn is_object_schema(o: &Map<String, Value>) -> bool {
    let typed = match o.get("type") {
        Some(Value::String(t)) => t == "object",
        Some(Value::Array(ts)) => ts.iter().any(|t| t == "object"),
        _ => false,
    };
    typed || o.contains_key("properties") || o.contains_key("required")
}

fn is_combined(o: &Map<String, Value>) -> bool {
    ["allOf", "anyOf", "oneOf", "$ref"]
        .iter()
        .any(|k| o.contains_key(*k))
}

/// Whether `o` says itself what keys beyond its properties may hold.
fn opens_itself(o: &Map<String, Value>) -> bool {
    o.contains_key("additionalProperties") || o.contains_key("unevaluatedProperties")
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn closed(mut v: Value) -> Value {
        close_objects(&mut v);
        v
    }

    #[test]
    fn objects_at_every_depth_are_closed() {
        let v = closed(json!({
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "where": {"properties": {"lat": {"type": "number"}}},
                "tags": {"type": "array", "items": {"type": "object", "properties": {"k": {}}}},
                "either": {"anyOf": [{"type": "object"}, {"type": "null"}]},
            },
            "$defs": {"Pet": {"type": "object", "properties": {"name": {"type": "string"}}}},
        }));
        assert_eq!(v["additionalProperties"], false);
        assert_eq!(v["properties"]["where"]["additionalProperties"], false);
        assert_eq!(
            v["properties"]["tags"]["items"]["additionalProperties"],
            false
        );
        assert_eq!(
            v["properties"]["either"]["anyOf"][0]["additionalProperties"],
            false
        );
        assert_eq!(
            v["properties"]["either"]["anyOf"][1],
            json!({"type": "null"})
        );
        assert_eq!(v["$defs"]["Pet"]["additionalProperties"], false);
        assert_eq!(v["properties"]["city"], json!({"type": "string"}));
    }

    #[test]
    fn a_schema_that_opens_an_object_keeps_it_open() {
        let open = json!({"type": "object", "additionalProperties": true});
        assert_eq!(closed(open.clone()), open);
        let values = json!({"type": "object", "additionalProperties": {"type": "object"}});
        assert_eq!(
            closed(values)["additionalProperties"],
            json!({"type": "object", "additionalProperties": false})
        );
    }

    #[test]
    fn combined_objects_stay_open_and_their_insides_close() {
        let v = closed(json!({
            "allOf": [
                {"type": "object", "properties": {"a": {"type": "object"}}},
                {"type": "object", "properties": {"b": {}}},
            ],
        }));
        assert!(v.get("additionalProperties").is_none());
        assert!(v["allOf"][0].get("additionalProperties").is_none());
        assert_eq!(
            v["allOf"][0]["properties"]["a"]["additionalProperties"],
            false
        );
        let r = closed(json!({"$ref": "#/$defs/P", "properties": {"x": {}}}));
        assert!(r.get("additionalProperties").is_none());
        // Not a schema: left as it is.
        assert_eq!(closed(json!(true)), json!(true));
    }
}
