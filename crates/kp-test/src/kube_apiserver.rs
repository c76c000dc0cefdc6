//! A real Kubernetes API server (etcd + kube-apiserver v1.28.7 on loopback) for tests and the
//! benchmark: what a cluster really sends (`managedFields`, resourceVersions, bookmarks, RBAC),
//! where the fake one ([`crate::apiserver`]) is scripted.
//!
//! It wraps `apiserver.sh` from the shared Kubernetes directory (`../shared/k8s/` beside the
//! workspace root, or `$KP_K8S_DIR`; [`k8s_dir`]). Each [`KubeApiServer`] has its own state
//! directory under the temporary directory and its own ports (`APISERVER_PORT`, `ETCD_PORT` and
//! `ETCD_PORT + 1`, found free on 127.0.0.1), so several run side by side; dropping it (also while
//! a test panics) stops both processes and deletes the directory. [`stop_all`] does the same for
//! every instance of this process, for a signal handler.
//!
//! - [`KubeApiServer::admin_kubeconfig`] and [`KubeApiServer::kube_proxy_kubeconfig`]: the
//!   script's kubeconfigs (`system:masters`; `system:kube-proxy`, bound to `system:node-proxier`).
//! - [`KubeApiServer::load_cluster`]: the bulk loader. It creates the generator's cluster
//!   ([`crate::cluster::Cluster`]: the `bench` Namespace, the Node, N Services and one
//!   EndpointSlice each) with the admin client, many requests at once, printing progress on
//!   standard error; a manifest's `status` (LoadBalancer ingress, Node addresses) is written
//!   through the status subresource, which a create ignores.
//! - [`KubeApiServer::replace`], [`KubeApiServer::count`] and [`KubeApiServer::get`]: single
//!   changes and reading back.
//! - [`KubeApiServer::bridge_into`]: makes the server reachable at the same
//!   `https://127.0.0.1:PORT` inside a network namespace, through a unix socket between two
//!   `socat`s, so a proxy in the namespace uses the kubeconfigs unchanged and nothing leaves
//!   loopback.
//!
//! [`upstream_kube_proxy`] unpacks upstream's kube-proxy v1.28.7 from the same directory and
//! checks its digest: the baseline the benchmark runs beside ours.
//!
//! Needs: the script and its archives, `etcd` and `openssl` (the script installs Debian's
//! `etcd-server` and `openssl` with apt-get when missing, which needs root: [`unavailable`] says
//! when this machine cannot start one, so a test can skip loudly), `curl` and `xz`; `socat` and
//! root for the bridge. The API server's Service range is `10.96.0.0/16` (its own `kubernetes`
//! Service takes `10.96.0.1`); [`KubeApiServer::start`] widens the NodePort range to
//! 30000-65535, as the generator allocates NodePorts past 32767 above ~18k Services.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::{Namespace, Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{Api, ApiResource, DynamicObject, ListParams, Patch, PatchParams, PostParams};
use serde_json::{json, Value};

use crate::cluster::{Cluster, NAMESPACE};
use crate::netns::{ChildGuard, Netns};
use crate::{Error, Result};

/// The environment variable that names the shared Kubernetes directory.
pub const K8S_DIR_ENV: &str = "KP_K8S_DIR";

/// Requests in flight while bulk loading.
pub const LOAD_CONCURRENCY: usize = 32;

/// Extra kube-apiserver flags every instance gets: a NodePort range as wide as the generator's.
const DEFAULT_ARGS: &str = "--service-node-port-range=30000-65535";

/// The shared Kubernetes directory: `$KP_K8S_DIR`, or `../shared/k8s` from the workspace root.
pub fn k8s_dir() -> PathBuf {
    if let Some(d) = std::env::var_os(K8S_DIR_ENV) {
        return PathBuf::from(d);
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR"))
        .ancestors()
        .nth(2)
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("."));
    root.join("../shared/k8s")
}

/// The start script, `apiserver.sh` in [`k8s_dir`].
pub fn script() -> PathBuf {
    k8s_dir().join("apiserver.sh")
}

fn on_path(program: &str) -> bool {
    Command::new("sh")
        .args(["-c", &format!("command -v {program}")])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Why this machine cannot start a real API server, or `None` when it can: the script is
/// missing, or `etcd`/`openssl` are missing and installing them needs root, or `curl`/`xz` are
/// missing. Tests print this and skip.
pub fn unavailable() -> Option<String> {
    let script = script();
    if !script.is_file() {
        return Some(format!(
            "no API server start script at {} (set {K8S_DIR_ENV} to the directory holding apiserver.sh)",
            script.display()
        ));
    }
    for tool in ["curl", "xz"] {
        if !on_path(tool) {
            return Some(format!("`{tool}` is not installed (apiserver.sh needs it)"));
        }
    }
    let missing: Vec<&str> = ["etcd", "openssl"]
        .into_iter()
        .filter(|t| !on_path(t))
        .collect();
    if !missing.is_empty() && !crate::netns::require_root() {
        return Some(format!(
            "{} not installed, and apiserver.sh installs it with apt-get only as root",
            missing.join(" and ")
        ));
    }
    None
}

/// The version of the shared upstream binaries.
pub const UPSTREAM_VERSION: &str = "v1.28.7";

/// Upstream's `kube-proxy` v1.28.7 from [`k8s_dir`], unpacked once per machine into
/// `$KP_K8S_CACHE` (default `/tmp/kp-k8s-v1.28.7`, where the script unpacks kube-apiserver) and
/// checked against its SHA-256 digest (`kube-proxy-v1.28.7.sha256`) every time. The baseline
/// to measure against; it is no part of the product.
pub fn upstream_kube_proxy() -> Result<PathBuf> {
    let dir = k8s_dir();
    let archive = dir.join(format!("kube-proxy-{UPSTREAM_VERSION}.xz"));
    let digest_file = dir.join(format!("kube-proxy-{UPSTREAM_VERSION}.sha256"));
    let io = |what: String| move |source| Error::Io { what, source };
    let want = std::fs::read_to_string(&digest_file)
        .map_err(io(format!("reading {}", digest_file.display())))?;
    let want = want
        .split_whitespace()
        .next()
        .unwrap_or_default()
        .to_string();
    let cache = std::env::var_os("KP_K8S_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(format!("/tmp/kp-k8s-{UPSTREAM_VERSION}")));
    let bin = cache.join("kube-proxy");
    let digest = |path: &Path| -> Result<String> {
        let out = Command::new("sha256sum")
            .arg(path)
            .output()
            .map_err(|source| Error::Spawn {
                command: format!("sha256sum {}", path.display()),
                source,
            })?;
        let text = String::from_utf8_lossy(&out.stdout);
        Ok(text
            .split_whitespace()
            .next()
            .unwrap_or_default()
            .to_string())
    };
    if bin.is_file() && digest(&bin)? == want {
        return Ok(bin);
    }
    std::fs::create_dir_all(&cache).map_err(io(format!("creating {}", cache.display())))?;
    // Unpacked beside it under a name of this process's, then renamed: a concurrent unpack
    // never sees half a binary.
    let tmp = cache.join(format!(".kube-proxy.{}", std::process::id()));
    let out = std::fs::File::create(&tmp).map_err(io(format!("creating {}", tmp.display())))?;
    let status = Command::new("xz")
        .arg("-dc")
        .arg(&archive)
        .stdout(out)
        .status()
        .map_err(|source| Error::Spawn {
            command: format!("xz -dc {}", archive.display()),
            source,
        })?;
    let got = if status.success() {
        digest(&tmp)?
    } else {
        String::new()
    };
    if got != want {
        let _ = std::fs::remove_file(&tmp);
        return Err(Error::InvalidArgument(format!(
            "{} unpacks to a binary whose SHA-256 is {got:?}, not {want:?} ({})",
            archive.display(),
            digest_file.display()
        )));
    }
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o755))
        .map_err(io(format!("chmod {}", tmp.display())))?;
    std::fs::rename(&tmp, &bin).map_err(io(format!("renaming to {}", bin.display())))?;
    Ok(bin)
}

/// Every running instance's script and directory, for [`stop_all`].
static LIVE: Mutex<Vec<(PathBuf, PathBuf)>> = Mutex::new(Vec::new());
static NEXT: AtomicUsize = AtomicUsize::new(0);

/// Stops every API server this process started and deletes their directories; returns how many.
/// For a SIGINT/SIGTERM handler, which ends the process without running destructors.
pub fn stop_all() -> usize {
    let live = std::mem::take(&mut *LIVE.lock().unwrap_or_else(PoisonError::into_inner));
    for (script, dir) in &live {
        stop(script, dir);
    }
    live.len()
}

fn stop(script: &Path, dir: &Path) {
    let _ = Command::new("bash")
        .arg(script)
        .arg("stop")
        .arg(dir)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
}

/// True when nothing listens on 127.0.0.1:`port` (we could bind it).
fn free(port: u16) -> bool {
    std::net::TcpListener::bind(("127.0.0.1", port)).is_ok()
}

/// Three free ports on loopback: the API server's, etcd's client port and etcd's peer port
/// (the one after it). Chosen from 20000-29999 by this process and instance, probed by binding.
fn free_ports(instance: usize) -> Result<(u16, u16)> {
    let seed = std::process::id() as usize * 7919
        + instance * 104_729
        + std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos() as usize);
    for attempt in 0..200usize {
        let base = 20000 + (seed + attempt * 3571) % 9997;
        let (api, etcd) = (base as u16, base as u16 + 1);
        if free(api) && free(etcd) && free(etcd + 1) {
            return Ok((api, etcd));
        }
    }
    Err(Error::InvalidArgument(
        "no three free consecutive ports on 127.0.0.1 in 20000-29999".into(),
    ))
}

fn api_error(what: impl Into<String>, e: impl std::fmt::Display) -> Error {
    Error::Api {
        what: what.into(),
        detail: e.to_string(),
    }
}

/// What a bulk load did.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Loaded {
    /// Objects created (the Namespace included).
    pub objects: usize,
    /// Status subresources written after their objects.
    pub statuses: usize,
    /// Wall-clock seconds.
    pub seconds: f64,
}

/// One running etcd + kube-apiserver pair. Stopped, and its directory deleted, on drop.
pub struct KubeApiServer {
    script: PathBuf,
    dir: PathBuf,
    port: u16,
    etcd_port: u16,
    // Dropped before the runtime (declared first).
    client: kube::Client,
    runtime: tokio::runtime::Runtime,
}

impl std::fmt::Debug for KubeApiServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KubeApiServer")
            .field("dir", &self.dir)
            .field("port", &self.port)
            .field("etcd_port", &self.etcd_port)
            .finish()
    }
}

impl KubeApiServer {
    /// Starts one (about 4 s; the first start on a machine also unpacks the binary). Fails when
    /// [`unavailable`] says why, or the script fails (its message says which log to read).
    pub fn start() -> Result<KubeApiServer> {
        KubeApiServer::start_with_args("")
    }

    /// Starts one with extra kube-apiserver flags (after the defaults, so a flag given here wins).
    pub fn start_with_args(extra: &str) -> Result<KubeApiServer> {
        if let Some(why) = unavailable() {
            return Err(Error::InvalidArgument(why));
        }
        let script = script();
        let instance = NEXT.fetch_add(1, Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!(
            "kp-kube-apiserver-{}-{instance}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        let (port, etcd_port) = free_ports(instance)?;
        let args = format!("{DEFAULT_ARGS} {extra}");
        let mut cmd = Command::new("bash");
        cmd.arg(&script)
            .arg("start")
            .arg(&dir)
            .env("APISERVER_PORT", port.to_string())
            .env("ETCD_PORT", etcd_port.to_string())
            .env("APISERVER_ARGS", args.trim())
            .stdin(Stdio::null());
        let command = format!(
            "APISERVER_PORT={port} ETCD_PORT={etcd_port} {} start {}",
            script.display(),
            dir.display()
        );
        LIVE.lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push((script.clone(), dir.clone()));
        let out = cmd.output().map_err(|source| Error::Spawn {
            command: command.clone(),
            source,
        })?;
        let forget = || {
            stop(&script, &dir);
            LIVE.lock()
                .unwrap_or_else(PoisonError::into_inner)
                .retain(|(_, d)| d != &dir);
        };
        if !out.status.success() {
            forget();
            return Err(Error::Command {
                command,
                status: out.status,
                stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
            });
        }
        let runtime = match tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("kp-kube-apiserver")
            .enable_all()
            .build()
        {
            Ok(r) => r,
            Err(source) => {
                forget();
                return Err(Error::Io {
                    what: "starting the API client's runtime".into(),
                    source,
                });
            }
        };
        let kubeconfig = dir.join("admin.kubeconfig");
        let client = runtime.block_on(async {
            let kc = kube::config::Kubeconfig::read_from(&kubeconfig)
                .map_err(|e| api_error(format!("reading {}", kubeconfig.display()), e))?;
            let config = kube::Config::from_custom_kubeconfig(kc, &Default::default())
                .await
                .map_err(|e| api_error("the admin kubeconfig", e))?;
            kube::Client::try_from(config).map_err(|e| api_error("the admin client", e))
        });
        let client = match client {
            Ok(c) => c,
            Err(e) => {
                forget();
                return Err(e);
            }
        };
        Ok(KubeApiServer {
            script,
            dir,
            port,
            etcd_port,
            client,
            runtime,
        })
    }

    /// Its URL: `https://127.0.0.1:PORT` (also inside a namespace it is bridged into).
    pub fn url(&self) -> String {
        format!("https://127.0.0.1:{}", self.port)
    }

    /// The API server's port on 127.0.0.1.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// etcd's client port on 127.0.0.1.
    pub fn etcd_port(&self) -> u16 {
        self.etcd_port
    }

    /// The state directory (deleted on drop).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The kubeconfig of user `admin` (`system:masters`).
    pub fn admin_kubeconfig(&self) -> PathBuf {
        self.dir.join("admin.kubeconfig")
    }

    /// The kubeconfig of user `system:kube-proxy` (the `system:node-proxier` role).
    pub fn kube_proxy_kubeconfig(&self) -> PathBuf {
        self.dir.join("kube-proxy.kubeconfig")
    }

    /// The CA certificate that signed the server's.
    pub fn ca_cert(&self) -> PathBuf {
        self.dir.join("ca.crt")
    }

    /// The last `lines` lines of kube-apiserver's log.
    pub fn log_tail(&self, lines: usize) -> String {
        let text =
            std::fs::read_to_string(self.dir.join("logs/kube-apiserver.log")).unwrap_or_default();
        let all: Vec<&str> = text.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }

    /// The admin client (it belongs to this server's runtime: use it through
    /// [`KubeApiServer::block_on`]).
    pub fn client(&self) -> kube::Client {
        self.client.clone()
    }

    /// Runs `f` on this server's runtime.
    pub fn block_on<F: std::future::Future>(&self, f: F) -> F::Output {
        self.runtime.block_on(f)
    }

    /// The API of the kind of `manifest` (Service, EndpointSlice, Node, Namespace), in its
    /// namespace.
    fn api_for(&self, manifest: &Value) -> Result<Api<DynamicObject>> {
        let kind = manifest["kind"].as_str().unwrap_or_default();
        let ns = manifest["metadata"]["namespace"].as_str();
        let (resource, namespaced) = resource(kind)?;
        Ok(match (namespaced, ns) {
            (true, Some(ns)) => Api::namespaced_with(self.client.clone(), ns, &resource),
            (true, None) => Api::default_namespaced_with(self.client.clone(), &resource),
            (false, _) => Api::all_with(self.client.clone(), &resource),
        })
    }

    async fn create_one(&self, manifest: &Value) -> Result<bool> {
        let api = self.api_for(manifest)?;
        let name = manifest["metadata"]["name"].as_str().unwrap_or_default();
        let what = || format!("creating {} {name}", manifest["kind"]);
        let object: DynamicObject =
            serde_json::from_value(manifest.clone()).map_err(|e| api_error(what(), e))?;
        let post = PostParams::default();
        retrying(what, || api.create(&post, &object)).await?;
        let status = &manifest["status"];
        if status.as_object().is_some_and(|s| !s.is_empty()) {
            let patch = Patch::Merge(json!({ "status": status }));
            let params = PatchParams::default();
            retrying(
                || format!("writing the status of {} {name}", manifest["kind"]),
                || api.patch_status(name, &params, &patch),
            )
            .await?;
            return Ok(true);
        }
        Ok(false)
    }

    /// Creates `objects` (manifests of the kinds the proxy watches, or Namespaces), up to
    /// `concurrency` requests at once, in no particular order (create a Namespace before its
    /// objects with a call of its own). Prints progress every 2 s on standard error.
    pub fn load(&self, objects: Vec<Value>, concurrency: usize) -> Result<Loaded> {
        let total = objects.len();
        self.load_stream(
            total,
            futures::stream::iter(objects.into_iter().map(|o| vec![o])),
            concurrency,
        )
    }

    /// Loads `cluster` (before any change): the `bench` Namespace, the Node, then each Service
    /// with its EndpointSlice, [`LOAD_CONCURRENCY`] requests at once. The objects are generated
    /// as they are sent, so a large cluster is never held in memory whole.
    pub fn load_cluster(&self, cluster: &Cluster) -> Result<Loaded> {
        let namespace = json!({
            "apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE},
        });
        let first = self.load(vec![namespace, Cluster::node_json()], 2)?;
        let groups = futures::stream::iter((0..cluster.services).map(|i| {
            vec![
                cluster.service_json(i),
                cluster.slice_json(i, &cluster.initial_endpoints(i)),
            ]
        }));
        let rest = self.load_stream(cluster.services * 2, groups, LOAD_CONCURRENCY)?;
        Ok(Loaded {
            objects: first.objects + rest.objects,
            statuses: first.statuses + rest.statuses,
            seconds: first.seconds + rest.seconds,
        })
    }

    /// Creates each group's objects in order, groups concurrently.
    fn load_stream(
        &self,
        total: usize,
        groups: impl futures::Stream<Item = Vec<Value>>,
        concurrency: usize,
    ) -> Result<Loaded> {
        let t0 = Instant::now();
        let done = Arc::new(AtomicUsize::new(0));
        let statuses = Arc::new(AtomicUsize::new(0));
        let url = self.url();
        let work = groups
            .map(|group| {
                let done = done.clone();
                let statuses = statuses.clone();
                async move {
                    for object in &group {
                        if self.create_one(object).await? {
                            statuses.fetch_add(1, Ordering::Relaxed);
                        }
                        done.fetch_add(1, Ordering::Relaxed);
                    }
                    Ok::<(), Error>(())
                }
            })
            .buffer_unordered(concurrency.max(1))
            .try_collect::<Vec<()>>();
        let report = {
            let done = done.clone();
            async move {
                loop {
                    tokio::time::sleep(Duration::from_secs(2)).await;
                    let n = done.load(Ordering::Relaxed);
                    let s = t0.elapsed().as_secs_f64();
                    eprintln!(
                        "kube-apiserver {url}: created {n} of {total} objects in {s:.0} s ({:.0}/s)",
                        n as f64 / s
                    );
                }
            }
        };
        self.runtime.block_on(async {
            tokio::select! {
                r = work => r.map(drop),
                () = report => Ok(()),
            }
        })?;
        Ok(Loaded {
            objects: done.load(Ordering::Relaxed),
            statuses: statuses.load(Ordering::Relaxed),
            seconds: t0.elapsed().as_secs_f64(),
        })
    }

    /// Replaces an object with `manifest` (unconditionally: no resourceVersion needed), as a
    /// controller's update does. Returns the new resourceVersion.
    pub fn replace(&self, manifest: &Value) -> Result<String> {
        let api = self.api_for(manifest)?;
        let name = manifest["metadata"]["name"].as_str().unwrap_or_default();
        let what = || format!("replacing {} {name}", manifest["kind"]);
        let object: DynamicObject =
            serde_json::from_value(manifest.clone()).map_err(|e| api_error(what(), e))?;
        let post = PostParams::default();
        let stored = self
            .runtime
            .block_on(retrying(what, || api.replace(name, &post, &object)))?;
        Ok(stored.metadata.resource_version.unwrap_or_default())
    }

    /// The object `kind`/`name` (in `namespace` for a namespaced kind) as JSON.
    pub fn get(&self, kind: &str, namespace: Option<&str>, name: &str) -> Result<Value> {
        let api = self.api_for(&json!({"kind": kind, "metadata": {"namespace": namespace}}))?;
        let o = self
            .runtime
            .block_on(api.get(name))
            .map_err(|e| api_error(format!("getting {kind} {name}"), e))?;
        serde_json::to_value(o).map_err(|e| api_error(format!("{kind} {name}"), e))
    }

    /// How many objects of `kind` there are (in `namespace`, or everywhere), listed in pages of
    /// 500 as an informer lists.
    pub fn count(&self, kind: &str, namespace: Option<&str>) -> Result<usize> {
        let api = self.api_for(&json!({"kind": kind, "metadata": {"namespace": namespace}}))?;
        let api = match namespace {
            Some(_) => api,
            None => Api::all_with(self.client.clone(), &resource(kind)?.0),
        };
        self.runtime.block_on(async {
            let mut n = 0;
            let mut params = ListParams::default().limit(500);
            loop {
                let page = api
                    .list(&params)
                    .await
                    .map_err(|e| api_error(format!("listing {kind}"), e))?;
                n += page.items.len();
                match page.metadata.continue_ {
                    Some(c) if !c.is_empty() => params = params.continue_token(&c),
                    _ => return Ok(n),
                }
            }
        })
    }

    /// Makes this server reachable inside `ns` at the same `https://127.0.0.1:PORT`: a `socat`
    /// in this namespace serves a unix socket connected to the server, and a `socat` in `ns`
    /// listens on 127.0.0.1:PORT there and connects to that socket. Needs root and `socat`. The
    /// bridge lasts until the returned guard is dropped.
    pub fn bridge_into(&self, ns: &Netns) -> Result<Bridge> {
        let socket = std::env::temp_dir().join(format!(
            "kp-kube-apiserver-{}-{}-{}.sock",
            std::process::id(),
            ns.name(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_file(&socket);
        let outside = Command::new("socat")
            .arg(format!("UNIX-LISTEN:{},fork,mode=600", socket.display()))
            .arg(format!("TCP:127.0.0.1:{}", self.port))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|source| Error::Spawn {
                command: "socat UNIX-LISTEN:… TCP:127.0.0.1:…".into(),
                source,
            })?;
        let mut bridge = Bridge {
            outside,
            inside: None,
            socket: socket.clone(),
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        while !socket.exists() {
            if Instant::now() > deadline {
                return Err(Error::NotReady {
                    what: format!("socat's socket {}", socket.display()),
                    after: Duration::from_secs(10),
                    detail: "never appeared".into(),
                });
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let listen = format!("TCP-LISTEN:{},bind=127.0.0.1,fork,reuseaddr", self.port);
        let connect = format!("UNIX-CONNECT:{}", socket.display());
        let inside = ns.spawn(&["socat", &listen, &connect])?;
        bridge.inside = Some(inside);
        // Ready when the namespace's end accepts.
        let port = self.port.to_string();
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let listening = ns
                .run(&["ss", "-Htln", "sport", "=", &format!(":{port}")])
                .unwrap_or_default();
            if !listening.trim().is_empty() {
                return Ok(bridge);
            }
            if Instant::now() > deadline {
                return Err(Error::NotReady {
                    what: format!("socat listening on 127.0.0.1:{port} in {}", ns.name()),
                    after: Duration::from_secs(10),
                    detail: bridge
                        .inside
                        .as_ref()
                        .map(ChildGuard::log)
                        .unwrap_or_default(),
                });
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for KubeApiServer {
    fn drop(&mut self) {
        stop(&self.script, &self.dir);
        LIVE.lock()
            .unwrap_or_else(PoisonError::into_inner)
            .retain(|(_, d)| d != &self.dir);
    }
}

/// A unix-socket bridge from a namespace's loopback to the API server
/// ([`KubeApiServer::bridge_into`]); both `socat`s are killed on drop.
#[derive(Debug)]
pub struct Bridge {
    outside: std::process::Child,
    inside: Option<ChildGuard>,
    socket: PathBuf,
}

impl Drop for Bridge {
    fn drop(&mut self) {
        self.inside = None;
        let _ = self.outside.kill();
        let _ = self.outside.wait();
        let _ = std::fs::remove_file(&self.socket);
    }
}

/// The API resource of `kind` and whether it is namespaced.
fn resource(kind: &str) -> Result<(ApiResource, bool)> {
    Ok(match kind {
        "Service" => (ApiResource::erase::<Service>(&()), true),
        "EndpointSlice" => (ApiResource::erase::<EndpointSlice>(&()), true),
        "Node" => (ApiResource::erase::<Node>(&()), false),
        "Namespace" => (ApiResource::erase::<Namespace>(&()), false),
        other => {
            return Err(Error::InvalidArgument(format!(
                "kind {other:?}: the loader knows Service, EndpointSlice, Node and Namespace"
            )))
        }
    })
}

/// Runs `request`, again after a pause while the server answers 429 or 5xx or the connection
/// fails (a loaded API server sheds requests with 429), at most 8 times.
async fn retrying<T, F, Fut>(what: impl Fn() -> String, request: F) -> Result<T>
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = kube::Result<T>>,
{
    let mut pause = Duration::from_millis(50);
    for attempt in 1.. {
        match request().await {
            Ok(v) => return Ok(v),
            Err(e) => {
                let transient = match &e {
                    kube::Error::Api(s) => s.code == 429 || s.code >= 500,
                    kube::Error::HyperError(_) | kube::Error::Service(_) => true,
                    _ => false,
                };
                if !transient || attempt >= 8 {
                    return Err(api_error(what(), e));
                }
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_secs(2));
            }
        }
    }
    unreachable!("the loop returns")
}

#[cfg(test)]
mod tests;
