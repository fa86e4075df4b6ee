//! Ending the cluster: stopping or killing components (by the pids this launcher spawned),
//! then unmounting what the kubelet mounted under the run directory, removing its sockets, its
//! log symlinks in /var/log/containers and the host directories this run created.

use std::{
    fs,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use super::{Cluster, Runtime, containerd};

/// Host directories the kubelet creates whatever its root dir is: the device-plugin socket
/// directory and the container-log symlink directory are compiled-in paths. Teardown removes
/// them again when this run created them and they are empty.
pub(super) const KUBELET_HOST_DIRS: [&str; 3] = [
    "/var/lib/kubelet/device-plugins",
    "/var/lib/kubelet",
    "/var/log/containers",
];

impl Cluster {
    /// Stops a component: SIGTERM, then SIGKILL after `grace`.
    pub fn stop(&mut self, name: &str, grace: Duration) {
        let Some(mut component) = self.components.remove(name) else {
            return;
        };
        signal(&component, libc::SIGTERM);
        let deadline = Instant::now() + grace;
        while Instant::now() < deadline {
            if let Ok(Some(_)) = component.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = component.kill();
        let _ = component.wait();
    }

    /// Kills a component with SIGKILL (a crash).
    pub fn kill(&mut self, name: &str) {
        if let Some(mut component) = self.components.remove(name) {
            let _ = component.kill();
            let _ = component.wait();
        }
    }

    /// Stops everything this launcher started, in reverse dependency order, and cleans up
    /// mounts, sockets and log symlinks. Idempotent.
    pub fn teardown(&mut self) {
        if self.torn_down {
            return;
        }
        self.torn_down = true;
        for name in [
            super::KUEUE,
            "migdra-kubelet-plugin",
            "migdra-controller",
            "kubelet",
            "containerd",
            "fake-cri",
            "kube-scheduler",
            "kube-controller-manager",
            "kube-apiserver",
            "etcd",
        ] {
            self.stop(name, Duration::from_secs(10));
        }
        let names: Vec<&'static str> = self.components.keys().copied().collect();
        for name in names {
            self.stop(name, Duration::from_secs(5));
        }
        let run_dir = fs::canonicalize(&self.layout.run_dir).unwrap_or_else(|_| self.layout.run_dir.clone());
        if self.layout.runtime == Runtime::Containerd {
            // The pods' containers, containerd's shims, its mounts and the pods' cgroups.
            if let Err(e) = containerd::clean(&run_dir, Some(&self.layout.run_dir)) {
                eprintln!("e2e: cleaning up containerd failed: {e:#}");
            }
        }
        unmount_under(&run_dir);
        unmount_under(&self.layout.run_dir);
        remove_log_symlinks_into(&[&run_dir, &self.layout.run_dir]);
        for socket in find_sockets(&run_dir) {
            let _ = fs::remove_file(socket);
        }
        for dir in &self.created_host_dirs {
            let _ = fs::remove_file(Path::new(dir).join("kubelet.sock"));
            let _ = fs::remove_dir(dir); // only succeeds when empty
        }
        if !self.layout.kubelet_root.starts_with(&self.layout.run_dir) {
            // Its own short directory, unmounted above (clean.sh).
            let _ = fs::remove_dir(&self.layout.kubelet_root);
        }
        let _ = fs::remove_file(&self.layout.run_dir); // the short symlink
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        self.teardown();
    }
}

fn signal(child: &Child, sig: i32) {
    if let Ok(pid) = i32::try_from(child.id()) {
        // SAFETY: kill(2) on a pid we spawned and have not reaped yet.
        #[allow(unsafe_code)]
        unsafe {
            libc::kill(pid, sig);
        }
    }
}

/// Mount points at or below `dir`, deepest first, from /proc/self/mountinfo.
fn mounts_under(dir: &Path) -> Vec<PathBuf> {
    let Ok(text) = fs::read_to_string("/proc/self/mountinfo") else {
        return Vec::new();
    };
    let mut mounts: Vec<PathBuf> = text
        .lines()
        .filter_map(|l| l.split_whitespace().nth(4))
        .map(|p| PathBuf::from(p.replace("\\040", " ")))
        .filter(|p| p.starts_with(dir))
        .collect();
    mounts.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
    mounts.dedup();
    mounts
}

fn unmount_under(dir: &Path) {
    for _ in 0..3 {
        let mounts = mounts_under(dir);
        if mounts.is_empty() {
            return;
        }
        for mount in mounts {
            let _ = Command::new("umount")
                .arg("-l")
                .arg(&mount)
                .stderr(Stdio::null())
                .status();
        }
    }
}

/// The kubelet links container logs into /var/log/containers; remove the links that point
/// into our run directory (by either of its paths; nothing else there is touched).
fn remove_log_symlinks_into(dirs: &[&Path]) {
    let Ok(entries) = fs::read_dir("/var/log/containers") else {
        return;
    };
    for entry in entries.flatten() {
        if let Ok(target) = fs::read_link(entry.path())
            && dirs.iter().any(|dir| target.starts_with(dir))
        {
            let _ = fs::remove_file(entry.path());
        }
    }
}

fn find_sockets(dir: &Path) -> Vec<PathBuf> {
    use std::os::unix::fs::FileTypeExt;
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(entries) = fs::read_dir(&d) else { continue };
        for entry in entries.flatten() {
            let Ok(kind) = entry.file_type() else { continue };
            if kind.is_dir() {
                stack.push(entry.path());
            } else if kind.is_socket() {
                out.push(entry.path());
            }
        }
    }
    out
}
