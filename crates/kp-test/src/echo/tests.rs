use std::net::{IpAddr, Ipv4Addr};
use std::time::Duration;

use super::*;

#[test]
fn every_outcome_reads_back_what_it_prints() {
    let outcomes = [
        Outcome::Answered {
            backend: "pod-a".to_string(),
            client_seen: "10.244.1.10".parse().unwrap(),
        },
        Outcome::Answered {
            backend: "pod-b".to_string(),
            client_seen: "2001:db8::2".parse().unwrap(),
        },
        Outcome::Timeout,
        Outcome::Refused,
        Outcome::Unreachable,
        Outcome::Reset,
        Outcome::Other("Operation not permitted (os error 1)".to_string()),
    ];
    for outcome in outcomes {
        assert_eq!(Outcome::parse(&outcome.to_string()), outcome);
    }
}

#[test]
fn unreadable_lines_become_other() {
    assert!(matches!(
        Outcome::parse("pod-a not-an-ip"),
        Outcome::Other(_)
    ));
    assert!(matches!(
        Outcome::parse("pod-a 10.0.0.1 extra"),
        Outcome::Other(_)
    ));
    assert!(matches!(Outcome::parse(""), Outcome::Other(_)));
}

#[test]
fn tally_counts_backends_and_failures() {
    let seen: IpAddr = Ipv4Addr::new(192, 0, 2, 2).into();
    let answered = |backend: &str| Outcome::Answered {
        backend: backend.to_string(),
        client_seen: seen,
    };
    let counts = tally(&[
        answered("pod-a"),
        answered("pod-b"),
        answered("pod-a"),
        Outcome::Timeout,
        Outcome::Other("x".to_string()),
    ]);
    let expected = [("error", 1), ("pod-a", 2), ("pod-b", 1), ("timeout", 1)];
    assert_eq!(
        counts
            .iter()
            .map(|(k, v)| (k.as_str(), *v))
            .collect::<Vec<_>>(),
        expected
    );
}

#[test]
fn a_request_becomes_the_documented_command_line() {
    let req = Request::new(Proto::Udp, "fd00:10:96::a".parse().unwrap(), 53)
        .count(5)
        .src_ip("2001:db8::3".parse().unwrap())
        .src_port(40000)
        .timeout(Duration::from_millis(300));
    assert_eq!(
        req.args().join(" "),
        "request udp fd00:10:96::a 53 --timeout-ms 300 --count 5 --src-ip 2001:db8::3 --src-port 40000"
    );
}

#[test]
fn an_sctp_request_names_its_protocol() {
    let req = Request::new(Proto::Sctp, "10.96.0.132".parse().unwrap(), 3868);
    assert!(req
        .args()
        .join(" ")
        .starts_with("request sctp 10.96.0.132 3868 "));
}

#[test]
#[ignore = "needs root"]
fn serving_sctp_works_exactly_where_the_kernel_has_it() {
    if !crate::require_root() {
        return;
    }
    let lab = crate::Lab::new(1).unwrap();
    let server = serve_on(
        lab.pod(0),
        "pod-0",
        &[(Proto::Tcp, 8080), (Proto::Sctp, 3868)],
    );
    match sctp_support() {
        Ok(()) => {
            let _server = server.expect("SCTP echo server");
            let out = lab.request(lab.client(), Proto::Sctp, lab.pod_ip(0), 3868);
            assert_eq!(out.backend(), Some("pod-0"), "{out:?}");
        }
        Err(why) => {
            eprintln!("SKIPPED the SCTP exchange: {why}");
            assert!(
                server.is_err(),
                "an SCTP port bound on a kernel without SCTP"
            );
        }
    }
}
