//! Start-up behaviour of the binary that needs no kernel: bad configuration exits 64 with a
//! message naming the problem.

use std::process::Command;

fn kube_proxy(args: &[&str]) -> (i32, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_kube-proxy"))
        .args(args)
        .output()
        .expect("run kube-proxy");
    let text =
        String::from_utf8_lossy(&out.stderr).into_owned() + &String::from_utf8_lossy(&out.stdout);
    (out.status.code().unwrap_or(-1), text)
}

#[test]
fn every_linux_mode_is_built_and_an_unknown_one_exits_64_naming_them() {
    for mode in kp_proxy::config::ProxyMode::ALL {
        assert!(
            kp_proxy::modes::find(mode).is_some(),
            "{} is not in the mode registry",
            mode.as_str()
        );
    }
    // Upstream's Windows-only mode: refused before anything starts.
    let dir = std::env::temp_dir();
    let (code, text) = kube_proxy(&[
        "--proxy-mode=kernelspace",
        "--manifests",
        dir.to_str().unwrap(),
    ]);
    assert_eq!(code, 64, "{text}");
    assert!(text.contains("kernelspace"), "{text}");
    for mode in kp_proxy::config::ProxyMode::ALL {
        assert!(text.contains(mode.as_str()), "{text}");
    }
}

#[test]
fn an_invalid_flag_value_or_config_field_exits_64_naming_it() {
    let (code, text) = kube_proxy(&["--proxy-mode=nftables", "--cluster-cidr=10.0.0.0/33"]);
    assert_eq!(code, 64, "{text}");
    assert!(text.contains("10.0.0.0/33"), "{text}");
    let dir = std::env::temp_dir().join(format!("kp-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("config.yaml");
    std::fs::write(
        &file,
        "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\nmode: nftables\nbogusField: 1\n",
    )
    .unwrap();
    let (code, text) = kube_proxy(&["--config", file.to_str().unwrap()]);
    assert_eq!(code, 64, "{text}");
    assert!(text.contains("bogusField"), "{text}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn write_config_to_writes_a_file_that_loads_back() {
    let dir = std::env::temp_dir().join(format!("kp-cli-w-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let out = dir.join("effective.yaml");
    let (code, text) = kube_proxy(&[
        "--proxy-mode=nftables",
        "--iptables-min-sync-period=250ms",
        "--write-config-to",
        out.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{text}");
    let yaml = std::fs::read_to_string(&out).unwrap();
    assert!(yaml.contains("mode: nftables"), "{yaml}");
    assert!(yaml.contains("250ms"), "{yaml}");
    let again = dir.join("again.yaml");
    let (code, text) = kube_proxy(&[
        "--config",
        out.to_str().unwrap(),
        "--write-config-to",
        again.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{text}");
    assert_eq!(std::fs::read_to_string(&again).unwrap(), yaml);
    let _ = std::fs::remove_dir_all(&dir);
}
