//! Fuzz target for the node's configuration file (`Config::parse`, what `ferry daemon
//! --config FILE` reads): whatever the file holds, the daemon gets a configuration or an
//! error, never a panic, and a configuration it accepts is written back (`to_toml`, as
//! `ferry cluster up` writes them) to one it reads the same.
//!
//! The inputs are edits of real configurations (the README's, and one as `ferry cluster up`
//! writes it). The target runs for a few seconds under `cargo test` (see `crates/ferry-fuzz`).

use bolero::TypeGenerator;
use ferry_daemon::config::Config;
use ferry_fuzz::{apply, Edit};
use std::time::Duration;

const SEEDS: [&str; 2] = [
    r#"name = "b"
listen = "10.0.0.2:7070"
data_dir = "/var/lib/ferry"
accept_guests = true
peers = ["10.0.0.1:7070"]
[credentials]
ca_cert = "/etc/ferry/ca.pem"
cert = "/etc/ferry/b.pem"
key = "/etc/ferry/b.key"
"#,
    r#"name = "node-c_3"
listen = "[::1]:7073"
data_dir = "/run/ferry/cluster/c"
peers = ["127.0.0.11:7070", "127.0.0.12:7070", "[::1]:9"]

[credentials]
ca_cert = "/run/ferry/cluster/ca.pem"
cert = "/run/ferry/cluster/c.pem"
key = "/run/ferry/cluster/c.key"
"#,
];

#[test]
fn seeds_parse() {
    for s in SEEDS {
        let c = Config::parse(s).unwrap();
        let again = Config::parse(&c.to_toml().unwrap()).unwrap();
        assert_eq!(again.to_toml().unwrap(), c.to_toml().unwrap());
    }
}

#[derive(Debug, TypeGenerator)]
struct ConfigEdits {
    seed: u8,
    edits: Vec<Edit>,
}

#[test]
fn fuzz_config() {
    bolero::check!()
        .with_type::<ConfigEdits>()
        .with_test_time(Duration::from_secs(3))
        .with_shrink_time(Duration::from_secs(10))
        .for_each(|e| {
            let seed = SEEDS[e.seed as usize % SEEDS.len()].as_bytes();
            let edits = &e.edits[..e.edits.len().min(1 + e.seed as usize / 2 % 4)];
            let bytes = apply(seed, edits);
            let text = String::from_utf8_lossy(&bytes);
            if let Ok(c) = Config::parse(&text) {
                let written = c.to_toml().expect("an accepted config cannot be written");
                let back = Config::parse(&written)
                    .unwrap_or_else(|e| panic!("{written:?} as written does not parse: {e:#}"));
                assert_eq!(
                    back.to_toml().unwrap(),
                    written,
                    "the config changed on the way"
                );
            }
        });
}
