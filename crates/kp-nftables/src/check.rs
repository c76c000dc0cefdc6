//! The periodic drift check's comparison, on digests: the table is read back keeping of each
//! element only a 64-bit digest of its key and one of its value ([`ElementDigest`], 16 bytes;
//! [`netlink::read_table_digests`](crate::netlink::read_table_digests)), and compared with the
//! same digests of the planner's elements, which are lent one at a time
//! ([`Planner::for_each_expected`]) and gathered one set at a time. Neither side is ever held
//! as tuples: at 10k Services × 10 endpoints the read-back as tuples was about 40 MB, the
//! proxy's peak; as digests it is 2 MB, and the largest set's planned digests another 2 MB.
//!
//! The check finds what the element-by-element comparison of [`crate::NftablesDataplane::verify`]
//! finds: chains and their rules, set names, and per set the elements missing, with another value
//! and extra, leaving out the keys written after the read began (see [`Touched`]). A digest
//! collision could only hide a difference (two different keys or values taken for equal), never
//! report one that is not there; at about 2^-64 per element compared that is below 10^-13 for
//! a million elements, and the next period's check compares again anyway.
//!
//! The difference line names an example element. A missing element, or one with another value,
//! is named from the plan (its key is the plan's); an extra one exists only in the kernel, so
//! the one set holding extra elements is read again in full to name one
//! ([`crate::NftablesDataplane::finish_check`]): only when the table differs, which the full
//! sync that follows repairs by reading the table anyway.

use std::collections::{BTreeMap, HashMap, HashSet};

use kp_core::model::IpFamily;
use kp_nftables_plan::element::{canonical, ElementDigest, Tuple};
use kp_nftables_plan::names;
use kp_nftables_plan::{KernelTable, Planner, SetId};

use crate::readback;

/// A table read back for the drift check: chains with their rule ids as
/// [`KernelTable`](crate::KernelTable) holds them, and each set's elements as digests sorted by
/// key digest (none for the sets the read's schema leaves out, the dynamic affinity maps).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DigestTable {
    /// Chain name → rule ids (comments) in order.
    pub chains: BTreeMap<String, Vec<String>>,
    /// Set or map name → its elements' digests, sorted by key digest.
    pub sets: BTreeMap<String, Vec<ElementDigest>>,
    /// The table's comment.
    pub comment: Option<String>,
}

/// The key digests ([`ElementDigest::key_of`]) of the elements a partial sync added or deleted
/// while a check's read ran, by family and set: the kernel may or may not have shown them to the
/// read, so both sides leave them out.
pub(crate) type Touched = HashMap<(IpFamily, SetId), HashSet<u64>>;

/// How one set differs from the plan.
#[derive(Debug)]
pub(crate) struct SetDifference {
    pub(crate) family: IpFamily,
    pub(crate) set: SetId,
    pub(crate) missing: usize,
    pub(crate) wrong: usize,
    pub(crate) extra: usize,
    /// ` (e.g. …)`, when an element could be named.
    pub(crate) example: Option<String>,
}

impl SetDifference {
    /// The difference line, as [`crate::NftablesDataplane::verify`] words it.
    pub(crate) fn line(&self) -> String {
        format!(
            "{}: set {}: {} elements missing, {} with another value, {} extra{}",
            names::family(self.family),
            self.set.name(),
            self.missing,
            self.wrong,
            self.extra,
            self.example.as_deref().unwrap_or_default()
        )
    }
}

/// Compares one family's table read back as digests with its planner: chains and set names as
/// [`readback::compare`] does, then each set's digests. Returns the chain and set-name
/// differences as lines, and the sets whose elements differ.
pub(crate) fn compare_family(
    p: &Planner,
    kernel: &mut DigestTable,
    touched: &Touched,
) -> (Vec<String>, Vec<SetDifference>) {
    let family = p.config().family;
    for c in kp_nftables_plan::layout::UNORDERED_CHAINS {
        if let Some(v) = kernel.chains.get_mut(*c) {
            v.sort();
        }
    }
    let all_sets = p.all_sets();
    let names = all_sets.iter().map(|s| (s.name(), None)).collect();
    // The names are all `readback::compare` needs of the sets.
    let structure = KernelTable {
        chains: std::mem::take(&mut kernel.chains),
        sets: kernel
            .sets
            .keys()
            .map(|n| (n.clone(), BTreeMap::new()))
            .collect(),
        comment: None,
    };
    let lines = readback::compare(
        names::family(family),
        &p.expected_chains(),
        &names,
        &structure,
    );
    let none = HashSet::new();
    let mut sets = Vec::new();
    for set in all_sets.into_iter().filter(|s| !s.is_dynamic()) {
        let Some(actual) = kernel.sets.remove(&set.name()) else {
            continue;
        };
        let skip = touched.get(&(family, set)).unwrap_or(&none);
        sets.extend(compare_set(p, set, &actual, skip));
    }
    (lines, sets)
}

/// Compares one set's digests read back (sorted by key digest) with the plan's: the planned
/// elements' digests are gathered and sorted too (16 bytes an element, for this set only), then
/// the two lists are merged. A merge walks both in order, where looking each planned key up in
/// the read would jump about the read's 2 MB for each of them (at 10k Services the lookups were
/// most of the comparison's time). Keys in `skip` are left out on both sides.
pub(crate) fn compare_set(
    p: &Planner,
    set: SetId,
    actual: &[ElementDigest],
    skip: &HashSet<u64>,
) -> Option<SetDifference> {
    let mut planned = Vec::with_capacity(p.expected_len(set));
    p.for_each_expected(set, |key, value| {
        let d = ElementDigest::of(key, value);
        if !skip.contains(&d.key) {
            planned.push(d);
        }
    });
    planned.sort_unstable();
    let mut actual = actual
        .iter()
        .filter(|d| skip.is_empty() || !skip.contains(&d.key))
        .peekable();
    let mut planned = planned.into_iter().peekable();
    let (mut missing, mut wrong, mut extra) = (0, 0, 0);
    // The first key of each kind of difference the plan can name.
    let (mut first_wrong, mut first_missing) = (None, None);
    loop {
        match (actual.peek(), planned.peek()) {
            (None, None) => break,
            (Some(_), None) => {
                extra += 1;
                actual.next();
            }
            (None, Some(want)) => {
                missing += 1;
                first_missing.get_or_insert(want.key);
                planned.next();
            }
            (Some(have), Some(want)) => match have.key.cmp(&want.key) {
                std::cmp::Ordering::Less => {
                    extra += 1;
                    actual.next();
                }
                std::cmp::Ordering::Greater => {
                    missing += 1;
                    first_missing.get_or_insert(want.key);
                    planned.next();
                }
                std::cmp::Ordering::Equal => {
                    if have.value != want.value {
                        wrong += 1;
                        first_wrong.get_or_insert(want.key);
                    }
                    actual.next();
                    planned.next();
                }
            },
        }
    }
    if missing + wrong + extra == 0 {
        return None;
    }
    // Only now, with a difference to show, the plan is walked again for the key to name.
    let example = match (first_wrong, first_missing) {
        (Some(k), _) => planned_key(p, set, k).map(|k| format!(" (e.g. {k} has another value)")),
        (None, Some(k)) => planned_key(p, set, k).map(|k| format!(" (e.g. {k} missing)")),
        (None, None) => None,
    };
    Some(SetDifference {
        family: p.config().family,
        set,
        missing,
        wrong,
        extra,
        example,
    })
}

/// The planned key of `set` whose digest is `digest`, spelled as the read-back spells it.
fn planned_key(p: &Planner, set: SetId, digest: u64) -> Option<Tuple> {
    let mut found = None;
    p.for_each_expected(set, |key, _| {
        if found.is_none() && ElementDigest::key_of(key) == digest {
            found = Some(canonical(&Tuple::new(key)));
        }
    });
    found
}

/// An extra element of `set` (read again in full as `elements`) to name in a difference line:
/// one whose key is not planned and was not written during the read. `None` if there is none
/// any more.
pub(crate) fn extra_example(
    p: &Planner,
    set: SetId,
    elements: &BTreeMap<Tuple, Option<Tuple>>,
    skip: Option<&HashSet<u64>>,
) -> Option<String> {
    elements
        .keys()
        .filter(|k| skip.is_none_or(|s| !s.contains(&ElementDigest::key_of(k.atoms()))))
        .find(|k| p.expected_value(set, k).is_none())
        .map(|k| format!(" (e.g. extra {k})"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use kp_nftables_plan::element::Atom;
    use kp_nftables_plan::PlanConfig;

    /// The fixture's IPv4 plan, and every set's digests as a faithful kernel would hold them.
    fn planned() -> (Planner, BTreeMap<SetId, Vec<ElementDigest>>) {
        let mut p = Planner::new(PlanConfig::new(IpFamily::V4));
        p.full(&kp_flows::state(), &kp_flows::node_context());
        let mut sets = BTreeMap::new();
        for set in p.all_sets() {
            let mut d = Vec::new();
            p.for_each_expected(set, |k, v| d.push(ElementDigest::of(k, v)));
            d.sort_unstable();
            sets.insert(set, d);
        }
        (p, sets)
    }

    /// The first element of a set with values, lent as tuples.
    fn first_element(p: &Planner, set: SetId) -> (Tuple, Option<Tuple>) {
        let mut first = None;
        p.for_each_expected(set, |k, v| {
            first.get_or_insert_with(|| (Tuple::new(k), v.map(Tuple::new)));
        });
        first.expect("a planned element")
    }

    #[test]
    fn a_faithful_kernel_has_no_difference() {
        let (p, sets) = planned();
        let mut checked = 0;
        for (set, digests) in &sets {
            assert!(compare_set(&p, *set, digests, &HashSet::new()).is_none());
            checked += digests.len();
        }
        assert!(checked > 30, "{checked}");
    }

    #[test]
    fn missing_extra_and_changed_elements_are_counted_and_keys_touched_left_out() {
        let (p, sets) = planned();
        let set = sets
            .iter()
            .find(|(s, d)| matches!(s, SetId::ClassEndpoints(..)) && d.len() >= 3)
            .map(|(s, _)| *s)
            .expect("an endpoint map with three elements");
        let mut digests = sets[&set].clone();
        // One element gone, one with another value, one added.
        let gone = digests.remove(0);
        digests[0].value ^= 1;
        let changed = digests[0];
        let extra_key = [Atom::Ip("10.96.99.99".parse().unwrap()), Atom::Port(1)];
        let extra = ElementDigest::of(&extra_key, None);
        digests.push(extra);
        digests.sort_unstable();

        let d = compare_set(&p, set, &digests, &HashSet::new()).expect("differences");
        assert_eq!((d.missing, d.wrong, d.extra), (1, 1, 1), "{d:?}");
        let line = d.line();
        assert!(
            line.starts_with(&format!(
                "ip: set {}: 1 elements missing, 1 with another value, 1 extra (e.g. ",
                set.name()
            )),
            "{line}"
        );
        // The example is one of the plan's keys (the changed or the missing one), spelled as the
        // read-back spells it.
        let named = |want: u64| {
            let mut name = None;
            p.for_each_expected(set, |k, _| {
                if ElementDigest::key_of(k) == want {
                    name = Some(canonical(&Tuple::new(k)).to_string());
                }
            });
            name.unwrap()
        };
        assert!(
            line.contains(&format!("{} has another value)", named(changed.key)))
                || line.contains(&format!("{} missing)", named(gone.key))),
            "{line}"
        );

        // Each key written during the read is left out on both sides.
        let skip = |keys: &[u64]| keys.iter().copied().collect::<HashSet<u64>>();
        let d = compare_set(&p, set, &digests, &skip(&[gone.key])).unwrap();
        assert_eq!((d.missing, d.wrong, d.extra), (0, 1, 1), "{d:?}");
        let d = compare_set(&p, set, &digests, &skip(&[changed.key, extra.key])).unwrap();
        assert_eq!((d.missing, d.wrong, d.extra), (1, 0, 0), "{d:?}");
        assert!(compare_set(
            &p,
            set,
            &digests,
            &skip(&[gone.key, changed.key, extra.key])
        )
        .is_none());
    }

    #[test]
    fn an_extra_element_is_named_from_the_set_read_again_unless_planned_or_touched() {
        let (p, _) = planned();
        let set = SetId::ClusterIps;
        let (planned_key, _) = first_element(&p, set);
        let stranger = Tuple::new([Atom::Ip("10.96.99.99".parse().unwrap())]);
        let read = BTreeMap::from([(planned_key, None), (stranger.clone(), None)]);
        assert_eq!(
            extra_example(&p, set, &read, None).as_deref(),
            Some(" (e.g. extra 10.96.99.99)")
        );
        let touched = HashSet::from([ElementDigest::key_of(stranger.atoms())]);
        assert_eq!(extra_example(&p, set, &read, Some(&touched)), None);
    }

    #[test]
    fn chains_and_set_names_are_compared_as_the_full_check_compares_them() {
        let (p, sets) = planned();
        let mut table = DigestTable {
            chains: p.expected_chains(),
            sets: sets.into_iter().map(|(s, d)| (s.name(), d)).collect(),
            comment: None,
        };
        table.chains.remove("services");
        table.sets.insert("stranger".into(), Vec::new());
        let (lines, differ) = compare_family(&p, &mut table, &Touched::new());
        assert!(differ.is_empty(), "{differ:?}");
        assert!(
            lines
                .iter()
                .any(|l| l == "ip: chain services is only in the plan"),
            "{lines:?}"
        );
        assert!(
            lines
                .iter()
                .any(|l| l == "ip: set stranger is only in the kernel"),
            "{lines:?}"
        );
    }
}
