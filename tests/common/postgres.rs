//! A throwaway PostgreSQL server on 127.0.0.1 for integration tests (the
//! Debian `postgresql` server binaries; `scripts/test.sh` installs them).

// Each consumer uses part of this module.
#![allow(dead_code)]

use std::path::PathBuf;
use std::process::Command;

/// A PostgreSQL server on 127.0.0.1, stopped (and its directory removed) on drop.
pub struct Postgres {
    bin: PathBuf,
    data: PathBuf,
    port: u16,
    as_postgres_user: bool,
    _dir: tempfile::TempDir,
}

fn find_pg_bin() -> PathBuf {
    let mut found: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .map(|rd| {
            rd.filter_map(|e| e.ok())
                .map(|e| e.path().join("bin"))
                .filter(|b| b.join("initdb").exists())
                .collect()
        })
        .unwrap_or_default();
    found.sort();
    match found.pop() {
        Some(b) => b,
        None => panic!(
            "PostgreSQL server binaries not found (/usr/lib/postgresql/*/bin/initdb): install them with `apt-get install -y --no-install-recommends postgresql` (scripts/test.sh does it)"
        ),
    }
}

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free loopback port")
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
        .unwrap_or(false)
}

impl Postgres {
    fn pg_cmd(&self, tool: &str) -> Command {
        let exe = self.bin.join(tool);
        if self.as_postgres_user {
            // initdb/postgres refuse to run as root.
            let mut c = Command::new("runuser");
            c.args(["-u", "postgres", "--"]).arg(exe);
            c
        } else {
            Command::new(exe)
        }
    }

    pub fn start() -> Postgres {
        let bin = find_pg_bin();
        let dir = tempfile::tempdir().expect("a temporary directory");
        let as_postgres_user = is_root();
        let root = dir.path().join("pg");
        std::fs::create_dir_all(&root).unwrap();
        if as_postgres_user {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
            let st = Command::new("chown")
                .args(["postgres:postgres"])
                .arg(&root)
                .status()
                .unwrap();
            assert!(st.success(), "chown postgres failed");
        }
        let pg = Postgres {
            bin,
            data: root.join("data"),
            port: free_port(),
            as_postgres_user,
            _dir: dir,
        };
        let out = pg
            .pg_cmd("initdb")
            .arg("-D")
            .arg(&pg.data)
            .args(["-U", "postgres", "--auth=trust", "-E", "UTF8", "--no-sync"])
            .output()
            .expect("run initdb");
        assert!(
            out.status.success(),
            "initdb failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let opts = format!(
            "-c listen_addresses=127.0.0.1 -p {} -k {} -c fsync=off",
            pg.port,
            root.display()
        );
        let out = pg
            .pg_cmd("pg_ctl")
            .arg("-D")
            .arg(&pg.data)
            .arg("-l")
            .arg(root.join("log"))
            .args(["-o", &opts, "-w", "-t", "30", "start"])
            .output()
            .expect("run pg_ctl start");
        assert!(
            out.status.success(),
            "pg_ctl start failed: {}{}\nlog: {}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
            std::fs::read_to_string(root.join("log")).unwrap_or_default()
        );
        pg
    }

    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    pub fn create_db(&self, name: &str) -> String {
        let mut c = postgres::Client::connect(&self.url(), postgres::NoTls).expect("connect");
        c.batch_execute(&format!("CREATE DATABASE {name}"))
            .expect("create database");
        format!("postgres://postgres@127.0.0.1:{}/{name}", self.port)
    }
}

impl Postgres {
    /// Restarts the server in place (`pg_ctl restart -m fast`): every open
    /// connection is closed, as in a failover or a maintenance restart.
    pub fn restart(&self) {
        let root = self.data.parent().expect("data dir parent").to_path_buf();
        let opts = format!(
            "-c listen_addresses=127.0.0.1 -p {} -k {} -c fsync=off",
            self.port,
            root.display()
        );
        let out = self
            .pg_cmd("pg_ctl")
            .arg("-D")
            .arg(&self.data)
            .arg("-l")
            .arg(root.join("log"))
            .args(["-o", &opts, "-m", "fast", "-w", "-t", "30", "restart"])
            .output()
            .expect("run pg_ctl restart");
        assert!(
            out.status.success(),
            "pg_ctl restart failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

impl Drop for Postgres {
    fn drop(&mut self) {
        let _ = self
            .pg_cmd("pg_ctl")
            .arg("-D")
            .arg(&self.data)
            .args(["-m", "immediate", "-w", "-t", "20", "stop"])
            .output();
    }
}
