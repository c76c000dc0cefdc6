//! What a run did and found.

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use kp_core::logsafe::escape;

/// The invariants a run checks; each violation names one.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Check {
    /// Decoding, the manifest parser, validation or a planner panicked.
    Panic,
    /// Rendered text (nft, iptables-restore input, a planner error) or a netlink batch holds
    /// the [marker](crate::hostile::MARKER): a field reached rule text unvalidated.
    Smuggled,
    /// Rendered text holds a control character other than the line breaks.
    ControlInRules,
    /// A rejected object's log line (`Rejected`'s `Display`) holds a control character.
    ControlInLog,
    /// The JSON manifest parser decoded an object differently from `serde_json::from_value`.
    ManifestDiffers,
    /// A tracer refused rendered text (a statement nft or iptables-restore would refuse).
    TracerRefused,
    /// The nftables planner made an element the netlink encoder cannot encode.
    EncodeError,
    /// Partial plans left the tables other than a fresh full plan of the same state would.
    Diverged,
    /// The iptables planner refused its own shared or fixed rules (`PlanError::Shared`): one
    /// object stops every iptables sync.
    SharedRuleRefused,
    /// A key the userspace, ipvs or ebpf planners made (a table element, a route, a virtual
    /// or real server, an ipset entry, a map entry) holds an address, port or network that is
    /// not one validation accepted for it.
    KeyNotValidated,
    /// A Service's endpoints are not what the precedence model says (its own EndpointSlices
    /// if it has any, else those mirrored from its Endpoints), or they changed since the last
    /// plan without the Service being in the recorded changes.
    Precedence,
    /// `ProxyState` accepted an Endpoints object the model finds invalid (an address that does
    /// not parse, a port out of range, an unknown protocol, a name that is not a DNS label).
    InvalidEndpointsAccepted,
}

impl fmt::Display for Check {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Check::Panic => "panic",
            Check::Smuggled => "smuggled text in rendered output",
            Check::ControlInRules => "control character in rendered output",
            Check::ControlInLog => "control character in a rejection log line",
            Check::ManifestDiffers => "manifest parser decodes differently",
            Check::TracerRefused => "tracer refused rendered text",
            Check::EncodeError => "netlink element encode error",
            Check::Diverged => "partial plans diverge from a full plan",
            Check::SharedRuleRefused => "iptables shared rule refused",
            Check::KeyNotValidated => "key from an unvalidated address, port or network",
            Check::Precedence => "endpoints differ from own slices else mirrored Endpoints",
            Check::InvalidEndpointsAccepted => "invalid Endpoints accepted",
        })
    }
}

/// A defect already found and recorded (with a minimal reproducer in the crate's `examples/`):
/// its violations are counted apart, so a run still fails on anything new.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KnownDefect {
    /// Its name in reports (the ignored test's name).
    pub name: &'static str,
    /// The check it breaks.
    pub check: Check,
    /// Text every violation it causes holds in its detail.
    pub needle: &'static str,
}

/// The known defects: none open (the fixed ones are tests in `tests/known_defects.rs`).
pub const KNOWN_DEFECTS: &[KnownDefect] = &[];

/// One broken invariant.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Violation {
    /// Which invariant.
    pub check: Check,
    /// The index of the object being handled, or the last one before the plan that failed.
    pub object: u64,
    /// What was seen (escaped, cut to a few hundred characters).
    pub detail: String,
}

/// Counts of one run, and the violations it found.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Report {
    /// The seed.
    pub seed: u64,
    /// Objects generated.
    pub objects: u64,
    /// Objects that decoded into their k8s-openapi type.
    pub decoded: u64,
    /// Objects carrying the [marker](crate::hostile::MARKER) somewhere.
    pub hostile: u64,
    /// Objects `ProxyState::apply` accepted.
    pub accepted: u64,
    /// Of those, objects carrying the marker: it sat in a field validation does not read
    /// (an annotation, a hostname, a zone hint), and the renderers had their chance to leak it.
    pub hostile_accepted: u64,
    /// Of those, Endpoints objects.
    pub endpoints_accepted: u64,
    /// Services whose endpoints were checked against the precedence model after an event.
    pub precedence_checks: u64,
    /// Over every plan, Services served by endpoints mirrored from their Endpoints.
    pub mirrored_served: u64,
    /// Times a Service with an Endpoints got its first own EndpointSlice or lost its last.
    pub precedence_flips: u64,
    /// Objects `ProxyState::apply` rejected.
    pub rejected: u64,
    /// Deletions applied.
    pub deletes: u64,
    /// Manifest texts parsed (single objects as JSON and YAML, multi-document files, lists,
    /// garbled text).
    pub manifests: u64,
    /// Manifest texts the parser refused.
    pub manifest_errors: u64,
    /// Of those, errors whose text holds a control character: harmless only because the
    /// binary's log formatter escapes every field (`kube-proxy/src/logging.rs`).
    pub manifest_errors_with_controls: u64,
    /// YAML texts (from the YAML serializer) that decoded differently from their JSON: noted,
    /// not a violation (the serializer is not this project's).
    pub yaml_differs: u64,
    /// Plans rendered (each planner call counts once: nftables text and split, iptables).
    pub plans: u64,
    /// Bytes of rendered text and netlink batches.
    pub bytes: u64,
    /// Elements in netlink batches.
    pub batch_elements: u64,
    /// Services the iptables planner left out because a rule failed its validation
    /// (`PlanError::Service`): by design, but each is a rule shape validation caught late.
    pub iptables_left_out: u64,
    /// Userspace mode: redirect table plans (text replayed into the tracer, balancer synced).
    pub userspace_plans: u64,
    /// Userspace mode: redirect table elements checked, over every plan.
    pub userspace_elements: u64,
    /// Userspace mode: balancer picks asked of validated frontends.
    pub userspace_picks: u64,
    /// ipvs mode: plans (virtual servers, ipsets, iptables chains).
    pub ipvs_plans: u64,
    /// ipvs mode: virtual servers checked, over every plan.
    pub ipvs_virtual_servers: u64,
    /// ipvs mode: ipset entries checked, over every plan.
    pub ipset_entries: u64,
    /// ebpf mode: plans (map updates of the changed Services).
    pub ebpf_plans: u64,
    /// ebpf mode: map updates checked.
    pub ebpf_ops: u64,
    /// ebpf mode: plans the planner refused (out of backend or reverse-NAT ids): by design,
    /// the mode then starts over.
    pub ebpf_errors: u64,
    /// The first few `PlanError::Service` texts, for the report.
    pub left_out_examples: Vec<String>,
    /// Wall-clock time.
    pub elapsed: Duration,
    /// Violations by check (known defects left out).
    pub counts: BTreeMap<Check, u64>,
    /// Violations of known defects, by defect name.
    pub known: BTreeMap<&'static str, u64>,
    /// The first violations of each check (a few per check).
    pub violations: Vec<Violation>,
}

/// Violations kept per check; the rest are only counted.
const KEEP: usize = 5;

impl Report {
    /// Records a violation.
    pub fn violation(&mut self, check: Check, object: u64, detail: &str) {
        if let Some(known) = KNOWN_DEFECTS
            .iter()
            .find(|k| k.check == check && detail.contains(k.needle))
        {
            let n = self.known.entry(known.name).or_default();
            *n += 1;
            if *n == 1 {
                // One example each, to show what it looks like.
                self.violations.push(Violation {
                    check,
                    object,
                    detail: short(detail, 600),
                });
            }
            return;
        }
        let n = self.counts.entry(check).or_default();
        *n += 1;
        if *n as usize <= KEEP {
            self.violations.push(Violation {
                check,
                object,
                detail: short(detail, 600),
            });
        }
    }

    /// Total violations, known defects left out.
    pub fn violation_count(&self) -> u64 {
        self.counts.values().sum()
    }

    /// Objects per second.
    pub fn rate(&self) -> f64 {
        self.objects as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }

    /// One line of figures, for progress and the final summary.
    pub fn summary(&self) -> String {
        format!(
            "seed={} objects={} hostile={} decoded={} accepted={} hostile_accepted={} \
             endpoints_accepted={} precedence_checks={} mirrored_served={} \
             precedence_flips={} rejected={} deletes={} manifests={} \
             manifest_errors={} plans={} bytes={} batch_elements={} iptables_left_out={} \
             userspace_plans={} userspace_elements={} userspace_picks={} \
             ipvs_plans={} ipvs_virtual_servers={} ipset_entries={} \
             ebpf_plans={} ebpf_ops={} ebpf_errors={} \
             violations={} known_defect_hits={} elapsed={:.1}s rate={:.0}/s",
            self.seed,
            self.objects,
            self.hostile,
            self.decoded,
            self.accepted,
            self.hostile_accepted,
            self.endpoints_accepted,
            self.precedence_checks,
            self.mirrored_served,
            self.precedence_flips,
            self.rejected,
            self.deletes,
            self.manifests,
            self.manifest_errors,
            self.plans,
            self.bytes,
            self.batch_elements,
            self.iptables_left_out,
            self.userspace_plans,
            self.userspace_elements,
            self.userspace_picks,
            self.ipvs_plans,
            self.ipvs_virtual_servers,
            self.ipset_entries,
            self.ebpf_plans,
            self.ebpf_ops,
            self.ebpf_errors,
            self.violation_count(),
            self.known.values().sum::<u64>(),
            self.elapsed.as_secs_f64(),
            self.rate(),
        )
    }
}

/// The summary line, then notes and violations one per line.
impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "{}", self.summary())?;
        writeln!(
            f,
            "notes: manifest_errors_with_controls={} yaml_differs={}",
            self.manifest_errors_with_controls, self.yaml_differs
        )?;
        for e in &self.left_out_examples {
            writeln!(f, "left out: {e}")?;
        }
        for (name, n) in &self.known {
            writeln!(f, "known defect {name}: {n}")?;
        }
        for (check, n) in &self.counts {
            writeln!(f, "VIOLATION {check}: {n}")?;
        }
        for v in &self.violations {
            writeln!(f, "  [{}] object {}: {}", v.check, v.object, v.detail)?;
        }
        Ok(())
    }
}

/// `s` escaped and cut to about `max` characters.
pub fn short(s: &str, max: usize) -> String {
    let e = escape(s);
    if e.chars().count() <= max {
        return e.into_owned();
    }
    let mut out: String = e.chars().take(max).collect();
    out.push('…');
    out
}
