use std::io;

use super::*;

#[test]
fn permission_and_missing_support_are_never_retried() {
    for errno in [1, 13, 93, 97] {
        assert_eq!(Retry::of_errno(errno), Retry::Never, "errno {errno}");
    }
    // EBUSY, ENOENT (an object gone between two reads), EINTR: a later attempt may succeed.
    for errno in [16, 2, 4] {
        assert_eq!(Retry::of_errno(errno), Retry::WithBackoff, "errno {errno}");
    }
}

#[test]
fn a_missing_or_forbidden_program_is_never_retried() {
    let missing = io::Error::from(io::ErrorKind::NotFound);
    let forbidden = io::Error::from_raw_os_error(13);
    let broken_pipe = io::Error::from(io::ErrorKind::BrokenPipe);
    assert_eq!(Retry::of_spawn(&missing), Retry::Never);
    assert_eq!(Retry::of_spawn(&forbidden), Retry::Never);
    assert_eq!(Retry::of_spawn(&broken_pipe), Retry::WithBackoff);
}

#[test]
fn the_error_shows_the_modes_message_and_keeps_its_type() {
    let e = DataplaneError::permanent(io::Error::other("nft: not installed"));
    assert_eq!(e.to_string(), "nft: not installed");
    assert_eq!(e.retry(), Retry::Never);
    assert!(e.inner().downcast_ref::<io::Error>().is_some());
}
