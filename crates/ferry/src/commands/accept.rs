//! `ferry accept yes|no`: whether this node takes guests from now on. Guests it already runs
//! stay (sending them home is eviction's job).

use super::client;
use anyhow::{bail, Result};
use ferry_transport::Msg;

#[derive(clap::Args)]
pub struct Args {
    #[arg(value_parser = ["yes", "no"])]
    pub answer: String,
}

pub fn run(a: Args, node: Option<&str>) -> Result<()> {
    let accepting = a.answer == "yes";
    match client::runtime()?.block_on(client::ask(node, &Msg::SetAccepting { accepting }))? {
        Msg::Done => Ok(()),
        other => bail!(
            "unexpected answer {}",
            ferry_transport::message::kind(&other)
        ),
    }
}
