use super::*;

#[test]
fn pod_addresses_share_their_digits_across_families() {
    assert_eq!(pod_ip(0), Ipv4Addr::new(10, 244, 1, 10));
    assert_eq!(pod_ip(5).to_string(), "10.244.1.15");
    assert_eq!(pod_ip6(5).to_string(), "fd00:10:244:1::15");
    assert_eq!(pod_ip(MAX_PODS - 1).to_string(), "10.244.1.209");
    assert_eq!(pod_ip6(MAX_PODS - 1).to_string(), "fd00:10:244:1::209");
}

#[test]
fn too_many_pods_is_refused_before_anything_is_created() {
    assert!(matches!(
        Lab::new(MAX_PODS + 1),
        Err(Error::InvalidArgument(_))
    ));
}
