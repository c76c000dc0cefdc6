use super::Splitter;

/// Items, resourceVersion and continue token of a list response.
type Split = (Vec<String>, Option<String>, Option<String>);

/// Feeds `body` in chunks of `chunk` bytes, returning the items and the list metadata's
/// resourceVersion and continue token.
fn split(body: &str, chunk: usize) -> Result<Split, String> {
    let mut s = Splitter::default();
    let mut items = Vec::new();
    for mut part in body.as_bytes().chunks(chunk) {
        while !part.is_empty() {
            let (used, complete) = s.feed(part).map_err(|e| e.to_string())?;
            if complete {
                items.push(String::from_utf8(s.item().to_vec()).unwrap());
            }
            part = &part[used..];
        }
    }
    let meta = s.finish().map_err(|e| e.to_string())?;
    Ok((items, meta.resource_version, meta.continue_))
}

const BODY: &str = r#"{"kind":"EndpointSliceList","apiVersion":"discovery.k8s.io/v1",
  "metadata":{"resourceVersion":"29330","continue":"tok"},
  "items":[
    {"metadata":{"name":"a","annotations":{"x":"has ] and } and \" and \\"}},"addressType":"IPv4"},
    {"metadata":{"name":"b"},"endpoints":[{"addresses":["10.0.0.1"]}],"items":[1,2]} ,
    {}
  ]}"#;

#[test]
fn items_are_split_whatever_the_chunks() {
    let want = split(BODY, BODY.len()).unwrap();
    assert_eq!(want.0.len(), 3);
    assert_eq!(
        want.0[0],
        r#"{"metadata":{"name":"a","annotations":{"x":"has ] and } and \" and \\"}},"addressType":"IPv4"}"#
    );
    assert_eq!(
        want.0[1],
        r#"{"metadata":{"name":"b"},"endpoints":[{"addresses":["10.0.0.1"]}],"items":[1,2]}"#
    );
    assert_eq!(want.0[2], "{}");
    assert_eq!(want.1.as_deref(), Some("29330"));
    assert_eq!(want.2.as_deref(), Some("tok"));
    for chunk in [1, 2, 3, 7, 64] {
        assert_eq!(split(BODY, chunk).unwrap(), want, "chunks of {chunk}");
    }
    // Every item is valid JSON on its own.
    for item in &want.0 {
        serde_json::from_str::<serde_json::Value>(item).unwrap();
    }
}

#[test]
fn the_envelope_is_read_wherever_the_metadata_is() {
    let body = r#"{"items":[{"a":1}],"kind":"ServiceList","metadata":{"resourceVersion":"5"}}"#;
    let (items, rv, cont) = split(body, 4).unwrap();
    assert_eq!(items, [r#"{"a":1}"#]);
    assert_eq!(rv.as_deref(), Some("5"));
    assert_eq!(cont, None);
    let empty = r#"{"kind":"ServiceList","metadata":{"resourceVersion":"6"},"items":[]}"#;
    assert_eq!(split(empty, 5).unwrap(), (vec![], Some("6".into()), None));
    // A null items list is an empty one.
    let null = r#"{"metadata":{"resourceVersion":"7"},"items":null}"#;
    assert_eq!(split(null, 3).unwrap(), (vec![], Some("7".into()), None));
}

#[test]
fn an_items_key_deeper_down_is_not_the_list() {
    let body = r#"{"metadata":{"resourceVersion":"8","items":[{"x":1}]},"items":[{"y":2}]}"#;
    let (items, rv, _) = split(body, 1).unwrap();
    assert_eq!(items, [r#"{"y":2}"#]);
    assert_eq!(rv.as_deref(), Some("8"));
}

#[test]
fn broken_responses_are_errors() {
    for body in [
        // Cut off inside an item, inside the list, inside a string.
        r#"{"metadata":{"resourceVersion":"1"},"items":[{"a":"#,
        r#"{"metadata":{"resourceVersion":"1"},"items":[{"a":1}"#,
        r#"{"metadata":{"resourceVersion":"1"},"items":[{"a":"x"#,
        // Items that are not objects.
        r#"{"metadata":{"resourceVersion":"1"},"items":["a"]}"#,
        r#"{"metadata":{"resourceVersion":"1"},"items":[1]}"#,
        r#"{"metadata":{"resourceVersion":"1"},"items":[[]]}"#,
        // Not JSON around the items.
        r#"{"metadata":{"resourceVersion":"1"},"items":[{"a":1}]]}"#,
        r#"{"metadata":{"resourceVersion":1},"items":[]}"#,
    ] {
        assert!(split(body, 3).is_err(), "{body}");
    }
}
