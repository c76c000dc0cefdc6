use std::time::Duration;

use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kp_core::track::{Kind, Object, ObjectKey, SourceEvent};
use kube::runtime::utils::Backoff;
use kube::runtime::watcher::Event;

use super::{endpoint_slice_selector, service_selector, RelistTracker, RetryPolicy, Unavailable};

fn svc(name: &str, rv: &str) -> Object {
    Object::Service(Box::new(Service {
        metadata: ObjectMeta {
            name: Some(name.into()),
            namespace: Some("ns".into()),
            resource_version: Some(rv.into()),
            ..ObjectMeta::default()
        },
        ..Service::default()
    }))
}

/// Renders events compactly so that whole sequences can be compared.
fn show(events: &[SourceEvent]) -> Vec<String> {
    events
        .iter()
        .map(|ev| match ev {
            SourceEvent::Upsert(obj) => format!("upsert {} {}", obj.kind(), obj.key()),
            SourceEvent::Delete(kind, key) => format!("delete {kind} {key}"),
            SourceEvent::Synced(kind) => format!("synced {kind}"),
        })
        .collect()
}

fn feed(tracker: &mut RelistTracker, events: Vec<Event<Object>>) -> Vec<String> {
    let out: Vec<SourceEvent> = events
        .into_iter()
        .flat_map(|ev| tracker.handle(ev))
        .collect();
    show(&out)
}

#[test]
fn initial_list_upserts_each_object_then_reports_synced() {
    let mut t = RelistTracker::new(Kind::Service);
    let out = feed(
        &mut t,
        vec![
            Event::Init,
            Event::InitApply(svc("a", "1")),
            Event::InitApply(svc("b", "2")),
            Event::InitDone,
        ],
    );
    assert_eq!(
        out,
        [
            "upsert Service ns/a",
            "upsert Service ns/b",
            "synced Service"
        ]
    );
}

#[test]
fn watch_events_become_upserts_and_deletes() {
    let mut t = RelistTracker::new(Kind::Service);
    feed(
        &mut t,
        vec![
            Event::Init,
            Event::InitApply(svc("a", "1")),
            Event::InitDone,
        ],
    );
    let out = feed(
        &mut t,
        vec![
            Event::Apply(svc("b", "2")),
            Event::Apply(svc("a", "3")),
            Event::Delete(svc("a", "4")),
        ],
    );
    assert_eq!(
        out,
        [
            "upsert Service ns/b",
            "upsert Service ns/a",
            "delete Service ns/a"
        ]
    );
}

#[test]
fn relist_deletes_objects_it_no_longer_lists_and_skips_unchanged_ones() {
    let mut t = RelistTracker::new(Kind::Service);
    feed(
        &mut t,
        vec![
            Event::Init,
            Event::InitApply(svc("a", "1")),
            Event::InitApply(svc("b", "2")),
            Event::InitApply(svc("c", "3")),
            Event::InitDone,
        ],
    );
    let out = feed(
        &mut t,
        vec![
            Event::Init,
            Event::InitApply(svc("a", "1")),
            Event::InitApply(svc("c", "9")),
            Event::InitApply(svc("d", "10")),
            Event::InitDone,
        ],
    );
    assert_eq!(
        out,
        [
            "upsert Service ns/c",
            "upsert Service ns/d",
            "delete Service ns/b",
            "synced Service"
        ]
    );
}

#[test]
fn a_relist_that_fails_half_way_deletes_nothing() {
    let mut t = RelistTracker::new(Kind::Service);
    feed(
        &mut t,
        vec![
            Event::Init,
            Event::InitApply(svc("a", "1")),
            Event::InitApply(svc("b", "2")),
            Event::InitDone,
        ],
    );
    // The first relist lists only "a", then fails: kube-runtime starts over with a new Init.
    let out = feed(
        &mut t,
        vec![
            Event::Init,
            Event::InitApply(svc("a", "1")),
            Event::Init,
            Event::InitApply(svc("a", "1")),
            Event::InitApply(svc("b", "2")),
        ],
    );
    assert_eq!(out, Vec::<String>::new());
    assert_eq!(feed(&mut t, vec![Event::InitDone]), ["synced Service"]);
}

#[test]
fn a_first_list_that_starts_over_deletes_what_the_new_attempt_no_longer_lists() {
    let mut t = RelistTracker::new(Kind::Service);
    // The first list reports "a" and "b" from its first page, then fails; "b" is deleted before
    // kube-runtime lists again from the start.
    let out = feed(
        &mut t,
        vec![
            Event::Init,
            Event::InitApply(svc("a", "1")),
            Event::InitApply(svc("b", "2")),
            Event::Init,
            Event::InitApply(svc("a", "1")),
            Event::InitApply(svc("c", "4")),
            Event::InitDone,
        ],
    );
    assert_eq!(
        out,
        [
            "upsert Service ns/a",
            "upsert Service ns/b",
            "upsert Service ns/c",
            "delete Service ns/b",
            "synced Service"
        ]
    );
    // A later re-list still compares with everything known.
    let out = feed(
        &mut t,
        vec![
            Event::Init,
            Event::InitApply(svc("c", "4")),
            Event::InitDone,
        ],
    );
    assert_eq!(out, ["delete Service ns/a", "synced Service"]);
}

#[test]
fn deleting_an_unknown_object_reports_nothing() {
    let mut t = RelistTracker::new(Kind::Service);
    assert!(t.handle(Event::Delete(svc("x", "1"))).is_empty());
}

#[test]
fn objects_without_resource_version_are_always_reported() {
    let mut t = RelistTracker::new(Kind::Service);
    let out = feed(
        &mut t,
        vec![Event::Apply(svc("a", "")), Event::Apply(svc("a", ""))],
    );
    assert_eq!(out, ["upsert Service ns/a", "upsert Service ns/a"]);
}

#[test]
fn nodes_are_keyed_without_namespace() {
    let mut t = RelistTracker::new(Kind::Node);
    let node = Object::Node(Box::new(Node {
        metadata: ObjectMeta {
            name: Some("node-1".into()),
            resource_version: Some("1".into()),
            ..ObjectMeta::default()
        },
        ..Node::default()
    }));
    feed(
        &mut t,
        vec![Event::Init, Event::InitApply(node), Event::InitDone],
    );
    let out = t.handle(Event::Init);
    assert!(out.is_empty());
    let out = t.handle(Event::InitDone);
    match &out[..] {
        [SourceEvent::Delete(Kind::Node, k), SourceEvent::Synced(Kind::Node)] => {
            assert_eq!(
                k,
                &ObjectKey {
                    namespace: String::new(),
                    name: "node-1".into()
                }
            );
        }
        other => panic!("unexpected {:?}", show(other)),
    }
}

#[test]
fn selectors_match_upstream() {
    assert_eq!(
        service_selector(),
        "!service.kubernetes.io/service-proxy-name,!service.kubernetes.io/headless"
    );
    assert_eq!(
        endpoint_slice_selector(),
        "!service.kubernetes.io/service-proxy-name"
    );
}

#[test]
fn exponential_retry_doubles_up_to_max_and_resets() {
    let mut b = RetryPolicy::Exponential {
        initial: Duration::from_millis(10),
        max: Duration::from_millis(35),
        recheck: Duration::from_secs(1),
    }
    .backoff();
    let first: Vec<u128> = b.by_ref().take(4).map(|d| d.as_millis()).collect();
    assert_eq!(first, [10, 20, 35, 35]);
    b.reset();
    assert_eq!(b.next(), Some(Duration::from_millis(10)));
}

#[test]
fn only_a_refused_list_or_watch_with_404_or_403_makes_an_api_unavailable() {
    use kube::core::Status;
    use kube::runtime::watcher::Error;

    let api = |code: u16, reason: &str| {
        kube::Error::Api(Status::failure("x", reason).with_code(code).boxed())
    };
    let cases = [
        (
            Error::InitialListFailed(api(404, "NotFound")),
            Some(Unavailable::NotServed),
        ),
        // A 404 whose body was no Status (a proxy's plain text): kube's client gives it a reason
        // of its own, so only the code tells.
        (
            Error::InitialListFailed(api(404, "Failed to parse error data")),
            Some(Unavailable::NotServed),
        ),
        (
            Error::InitialListFailed(api(403, "Forbidden")),
            Some(Unavailable::Forbidden),
        ),
        (
            Error::WatchStartFailed(api(404, "NotFound")),
            Some(Unavailable::NotServed),
        ),
        (
            Error::WatchStartFailed(api(403, "Forbidden")),
            Some(Unavailable::Forbidden),
        ),
        (Error::InitialListFailed(api(500, "InternalError")), None),
        (
            Error::WatchStartFailed(api(503, "ServiceUnavailable")),
            None,
        ),
        // An ERROR event inside a watch is about that watch, not about the API.
        (
            Error::WatchError(Status::failure("x", "NotFound").with_code(404).boxed()),
            None,
        ),
        (Error::WatchFailed(api(403, "Forbidden")), None),
        (Error::NoResourceVersion, None),
    ];
    for (err, want) in cases {
        assert_eq!(Unavailable::of_error(&err), want, "{err:?}");
    }
}
