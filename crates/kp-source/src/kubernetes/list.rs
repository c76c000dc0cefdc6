//! Reading a list response one item at a time, as it arrives.
//!
//! kube's `Api::list` reads the whole response body, copies it into a `String`, then decodes
//! every item before the first can be used: at 10k EndpointSlices from a real API server (27 MB
//! of JSON, served in one response from its watch cache) that is about 54 MB of text plus every
//! decoded object at once. [`PageReader`] instead splits the body into its items while it is
//! read ([`Splitter`]), so that each item is decoded, handed over and dropped before the next
//! is read: memory stays at one item and one read buffer, and decoding overlaps the transfer.

use std::pin::Pin;

use futures::io::{AsyncBufRead, AsyncBufReadExt};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ListMeta;
use kube::api::ListParams;
use serde::Deserialize;

/// An error of the response's JSON framing (not of one item).
fn framing(msg: &str) -> kube::Error {
    kube::Error::SerdeError(<serde_json::Error as serde::de::Error>::custom(format!(
        "list response: {msg}"
    )))
}

/// Where the splitter is in the response.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    /// Outside `items`: bytes go to the envelope.
    Envelope,
    /// Inside the `items` array, between two items.
    Between,
    /// Inside an item: bytes go to the item.
    Item,
}

/// Splits a JSON list response (`{"kind":…,"metadata":{…},"items":[{…},{…}]}`) into its items,
/// and keeps the rest (the envelope, with `"items":[]`) to be decoded at the end.
///
/// It follows only what it must of JSON: nesting depth, and strings (with their escapes) so
/// that brackets inside them are not counted. Everything else is left to serde_json when each
/// item, and the envelope, is decoded.
#[derive(Debug)]
pub(crate) struct Splitter {
    mode: Mode,
    depth: u32,
    in_string: bool,
    escaped: bool,
    envelope: Vec<u8>,
    item: Vec<u8>,
}

impl Default for Splitter {
    fn default() -> Self {
        Splitter {
            mode: Mode::Envelope,
            depth: 0,
            in_string: false,
            escaped: false,
            envelope: Vec::with_capacity(512),
            item: Vec::new(),
        }
    }
}

impl Splitter {
    /// Reads from `bytes` until an item is complete or `bytes` is used up. Returns how many
    /// bytes were used and whether an item is complete (then in [`Splitter::item`], until the
    /// next call).
    pub(crate) fn feed(&mut self, bytes: &[u8]) -> Result<(usize, bool), kube::Error> {
        let mut i = 0;
        while i < bytes.len() {
            let b = bytes[i];
            i += 1;
            if self.in_string {
                if self.escaped {
                    self.escaped = false;
                } else if b == b'\\' {
                    self.escaped = true;
                } else if b == b'"' {
                    self.in_string = false;
                }
                self.push(b);
                continue;
            }
            match b {
                b'"' => {
                    if self.mode == Mode::Between {
                        return Err(framing("an item that is not an object"));
                    }
                    self.in_string = true;
                    self.push(b);
                }
                b'{' | b'[' => {
                    self.depth += 1;
                    match self.mode {
                        Mode::Envelope if self.depth == 2 && b == b'[' && self.at_items() => {
                            self.mode = Mode::Between;
                            self.envelope.extend_from_slice(b"[]");
                        }
                        Mode::Between if b == b'{' => {
                            self.mode = Mode::Item;
                            self.item.clear();
                            self.item.push(b);
                        }
                        Mode::Between => return Err(framing("an item that is not an object")),
                        _ => self.push(b),
                    }
                }
                b'}' | b']' => {
                    if self.depth == 0 {
                        return Err(framing("unbalanced brackets"));
                    }
                    self.depth -= 1;
                    match self.mode {
                        Mode::Between => self.mode = Mode::Envelope,
                        Mode::Item => {
                            self.item.push(b);
                            if self.depth == 2 {
                                self.mode = Mode::Between;
                                return Ok((i, true));
                            }
                        }
                        Mode::Envelope => self.envelope.push(b),
                    }
                }
                // Commas and whitespace between items.
                _ if self.mode == Mode::Between => {
                    if !(b == b',' || b.is_ascii_whitespace()) {
                        return Err(framing("an item that is not an object"));
                    }
                }
                _ => self.push(b),
            }
        }
        Ok((i, false))
    }

    /// The item completed by the last [`Splitter::feed`].
    pub(crate) fn item(&self) -> &[u8] {
        &self.item
    }

    /// Decodes the envelope's list metadata once the response is read.
    pub(crate) fn finish(self) -> Result<ListMeta, kube::Error> {
        if self.depth != 0 || self.in_string || self.mode != Mode::Envelope {
            return Err(framing("truncated"));
        }
        #[derive(Deserialize)]
        struct Envelope {
            #[serde(default)]
            metadata: ListMeta,
        }
        serde_json::from_slice::<Envelope>(&self.envelope)
            .map(|e| e.metadata)
            .map_err(kube::Error::SerdeError)
    }

    fn push(&mut self, b: u8) {
        match self.mode {
            Mode::Item => self.item.push(b),
            _ => self.envelope.push(b),
        }
    }

    /// Whether the envelope so far ends with the key `"items"` and its colon: the array that
    /// opens now is the list's items.
    fn at_items(&self) -> bool {
        let text = self.envelope.trim_ascii_end();
        let Some(text) = text.strip_suffix(b":") else {
            return false;
        };
        text.trim_ascii_end().ends_with(b"\"items\"")
    }
}

/// One list response being read.
pub(crate) struct PageReader {
    body: Pin<Box<dyn AsyncBufRead + Send>>,
    splitter: Splitter,
}

impl PageReader {
    /// Sends the list request for the collection at `path`.
    pub(crate) async fn open(
        client: &kube::Client,
        path: &str,
        params: &ListParams,
    ) -> Result<PageReader, kube::Error> {
        let request = kube::core::Request::new(path)
            .list(params)
            .map_err(kube::Error::BuildRequest)?;
        let body = client.request_stream(request).await?;
        Ok(PageReader {
            body: Box::pin(body),
            splitter: Splitter::default(),
        })
    }

    /// The next item's JSON, or `None` once the response holds no more.
    pub(crate) async fn next_item(&mut self) -> Result<Option<&[u8]>, kube::Error> {
        loop {
            let buf = self
                .body
                .fill_buf()
                .await
                .map_err(kube::Error::ReadEvents)?;
            if buf.is_empty() {
                return Ok(None);
            }
            let (used, complete) = self.splitter.feed(buf)?;
            self.body.as_mut().consume(used);
            if complete {
                return Ok(Some(self.splitter.item()));
            }
        }
    }

    /// The list's metadata (resourceVersion, continue token), once [`PageReader::next_item`]
    /// returned `None`.
    pub(crate) fn finish(self) -> Result<ListMeta, kube::Error> {
        self.splitter.finish()
    }
}

#[cfg(test)]
mod tests;
