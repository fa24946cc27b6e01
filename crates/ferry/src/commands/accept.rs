//! `ferry accept always|idle|never` (and the older `yes|no`: always, never): when this node
//! takes guests from now on. `idle`: only while its owner is away and the machine is idle, and
//! the owner's input sends the guests away. Ends a `ferry drain`. Guests it already runs stay
//! (`ferry evict` sends them away).

use super::client;
use anyhow::{bail, Result};
use ferry_transport::Msg;

#[derive(clap::Args)]
pub struct Args {
    #[arg(value_parser = ["always", "idle", "never", "yes", "no"])]
    pub answer: String,
}

pub fn run(a: Args, node: Option<&str>) -> Result<()> {
    let policy = match a.answer.as_str() {
        "yes" => "always",
        "no" => "never",
        p => p,
    };
    let msg = Msg::SetAcceptPolicy {
        policy: policy.to_string(),
    };
    match client::runtime()?.block_on(client::ask(node, &msg))? {
        Msg::Done => Ok(()),
        other => bail!(
            "unexpected answer {}",
            ferry_transport::message::kind(&other)
        ),
    }
}
