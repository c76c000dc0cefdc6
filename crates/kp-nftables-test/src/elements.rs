//! Set and map elements as nft text spells them: the part of replaying a transaction that is
//! the same whatever the table's shape. [`crate::NftTracer`] (the nftables mode's `ip`/`ip6`
//! tables) and `kp-userspace-test`'s tracer (the userspace mode's `inet` table) both keep their
//! sets in these terms.

use std::collections::BTreeMap;

use kp_nftables_plan::element::{canonical, parse_tuple, Atom, Tuple};

/// A set's or map's elements: key to value (`None` for a set), spelled as the kernel's
/// read-back spells them ([`canonical`]).
pub type Elements = BTreeMap<Tuple, Option<Tuple>>;

/// Why the elements of an `add element` or `delete element` statement were refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ElementTextError {
    /// An element or value that does not parse (the tracer does not know the shape).
    #[error("unsupported {0}")]
    Unsupported(&'static str),
    /// A value for a set, or none for a map.
    #[error("element shape does not fit")]
    Shape,
    /// An added element is there already (the planner adds it twice).
    #[error("element exists: {0}")]
    Exists(String),
    /// A deleted element is not there.
    #[error("delete of a missing element: {0}")]
    Missing(String),
}

/// Splits `NAME { BODY }` into the name and the body inside the braces (`None` without
/// braces).
pub fn split_name(rest: &str) -> (&str, Option<&str>) {
    match rest.split_once(' ') {
        None => (rest, None),
        Some((name, body)) => {
            let body = body.trim();
            let inner = body
                .strip_prefix('{')
                .and_then(|b| b.strip_suffix('}'))
                .map(str::trim);
            (name, inner)
        }
    }
}

/// Applies the body of an `add element` (`add`) or `delete element` statement, `k, k : v, …`,
/// to `elements` of a set (`map` false) or map. Stops at the first refused element.
pub fn apply_elements(
    elements: &mut Elements,
    map: bool,
    add: bool,
    body: &str,
) -> Result<(), ElementTextError> {
    for el in body.split(", ").filter(|e| !e.trim().is_empty()) {
        let (k, v) = match el.split_once(" : ") {
            Some((k, v)) => (k, Some(v)),
            None => (el, None),
        };
        let key = parse_tuple(k)
            .map(|t| canonical(&t))
            .map_err(|_| ElementTextError::Unsupported("element"))?;
        if add {
            let value = v
                .map(|v| parse_tuple(v).map(|t| canonical(&t)))
                .transpose()
                .map_err(|_| ElementTextError::Unsupported("element value"))?;
            if map != value.is_some() {
                return Err(ElementTextError::Shape);
            }
            if elements.insert(key, value).is_some() {
                return Err(ElementTextError::Exists(k.to_string()));
            }
        } else if elements.remove(&key).is_none() {
            return Err(ElementTextError::Missing(k.to_string()));
        }
    }
    Ok(())
}

/// The first element whose key matches `probe` (the packet's values for the lookup's
/// selectors), with its value: an interval element matches the addresses it holds, numbers
/// match whether spelled as ports or slots.
pub fn lookup<'a>(elements: &'a Elements, probe: &[Atom]) -> Option<&'a Option<Tuple>> {
    elements
        .iter()
        .find(|(k, _)| {
            k.atoms().len() == probe.len()
                && k.atoms().iter().zip(probe).all(|(a, b)| atom_matches(a, b))
        })
        .map(|(_, v)| v)
}

/// A number atom's value (a port or a slot).
pub fn num(a: &Atom) -> Option<u32> {
    match a {
        Atom::Port(p) => Some(u32::from(*p)),
        Atom::Slot(s) => Some(*s),
        _ => None,
    }
}

/// Whether an element's atom matches a packet's.
pub fn atom_matches(element: &Atom, probe: &Atom) -> bool {
    match (element, probe) {
        (Atom::Net(n), Atom::Ip(ip)) => n.contains(ip),
        (a, b) if num(a).is_some() => num(a) == num(b),
        (a, b) => a == b,
    }
}
