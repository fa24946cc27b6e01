//! `ferry top`: the cluster live, refreshing in place: a nodes pane (load, runnable, CPU idle,
//! free memory, whether the owner is at the machine, whether it takes guests, its guests) and
//! a processes pane (home and PID there, where it runs, CPU use, state, what it costs its
//! home). Keys: `q` (or Esc, ^C) quits, `s` changes the sort. `--once` prints one snapshot
//! instead (`--json` for scripts). One `Cluster` question to the daemon per refresh; the
//! columns are the daemon's (ferry_daemon::view), shared with its web page.

use super::client;
use anyhow::{bail, Context, Result};
use ferry_daemon::view::{self, NODE_COLUMNS, PROC_COLUMNS};
use ferry_transport::message::{ClusterView, ProcView};
use ferry_transport::Msg;
use ratatui::crossterm::event::{self, Event, KeyCode, KeyEventKind, KeyModifiers};
use ratatui::layout::{Constraint, Layout};
use ratatui::style::{Modifier, Style};
use ratatui::text::Line;
use ratatui::widgets::{Block, Borders, Paragraph, Row, Table};
use std::time::{Duration, Instant};

#[derive(clap::Args)]
pub struct Args {
    /// Print one snapshot and exit.
    #[arg(long)]
    pub once: bool,
    /// With --once: the snapshot as JSON (the daemon's `ClusterView`).
    #[arg(long, requires = "once")]
    pub json: bool,
    /// Seconds between refreshes.
    #[arg(long, default_value_t = 1.0)]
    pub interval: f64,
    /// How processes are sorted first (`s` cycles through them).
    #[arg(long, value_enum, default_value_t = Sort::Cpu)]
    pub sort: Sort,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Sort {
    /// Busiest processes and nodes first.
    Cpu,
    /// By home node and PID.
    Home,
    /// By the node they run on.
    Node,
    /// Oldest first.
    Age,
}

impl Sort {
    fn next(self) -> Sort {
        match self {
            Sort::Cpu => Sort::Home,
            Sort::Home => Sort::Node,
            Sort::Node => Sort::Age,
            Sort::Age => Sort::Cpu,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Sort::Cpu => "cpu",
            Sort::Home => "home",
            Sort::Node => "node",
            Sort::Age => "age",
        }
    }
}

fn fetch(rt: &tokio::runtime::Runtime, node: Option<&str>) -> Result<ClusterView> {
    match rt.block_on(client::ask(node, &Msg::Cluster))? {
        Msg::View(v) => Ok(v),
        other => bail!(
            "unexpected answer {} (is the daemon older than this ferry?)",
            ferry_transport::message::kind(&other)
        ),
    }
}

/// Orders the view's nodes and processes by `sort`.
fn sorted(mut v: ClusterView, sort: Sort) -> ClusterView {
    let cpu = |p: &ProcView| p.cpu_pct.unwrap_or(-1.0);
    let home = |p: &ProcView| (p.info.home_node.clone(), p.info.home_pid);
    match sort {
        Sort::Cpu => {
            v.processes.sort_by(|a, b| {
                cpu(b)
                    .total_cmp(&cpu(a))
                    .then_with(|| home(a).cmp(&home(b)))
            });
            let load = |n: &ferry_transport::message::NodeInfo| {
                n.load.as_ref().map_or(f64::MAX, |l| l.busyness())
            };
            v.nodes.sort_by(|a, b| {
                load(b)
                    .total_cmp(&load(a))
                    .then_with(|| a.name.cmp(&b.name))
            });
        }
        Sort::Home => v.processes.sort_by_key(home),
        Sort::Node => v
            .processes
            .sort_by(|a, b| (&a.info.node, home(a)).cmp(&(&b.info.node, home(b)))),
        Sort::Age => v.processes.sort_by_key(|p| (p.info.since_unix_ms, home(p))),
    }
    if sort != Sort::Cpu {
        v.nodes.sort_by(|a, b| a.name.cmp(&b.name));
    }
    v
}

fn rows(v: &ClusterView) -> (Vec<Vec<String>>, Vec<Vec<String>>) {
    (
        v.nodes.iter().map(view::node_row).collect(),
        v.processes
            .iter()
            .map(|p| view::proc_row(p, v.taken_unix_ms))
            .collect(),
    )
}

fn widths(columns: &[&str], rows: &[Vec<String>]) -> Vec<usize> {
    let mut w: Vec<usize> = columns.iter().map(|c| c.len()).collect();
    for r in rows {
        for (i, c) in r.iter().enumerate() {
            if i < w.len() {
                w[i] = w[i].max(c.chars().count());
            }
        }
    }
    w
}

fn print_table(columns: &[&str], rows: &[Vec<String>]) {
    let w = widths(columns, rows);
    let line = |cells: Vec<String>| {
        let last = cells.len().saturating_sub(1);
        let text: Vec<String> = cells
            .into_iter()
            .enumerate()
            .map(|(i, c)| {
                if i == last {
                    c
                } else {
                    format!("{c:<width$}", width = w[i])
                }
            })
            .collect();
        println!("{}", text.join("  ").trim_end());
    };
    line(columns.iter().map(|c| c.to_string()).collect());
    for r in rows {
        line(r.clone());
    }
}

pub fn run(a: Args, node: Option<&str>) -> Result<()> {
    if !(a.interval > 0.0 && a.interval.is_finite()) {
        bail!("--interval {}: a number of seconds above 0", a.interval);
    }
    let rt = client::runtime()?;
    let first = fetch(&rt, node)?;
    if a.once {
        let v = sorted(first, a.sort);
        if a.json {
            return super::print_json(&v);
        }
        let (nodes, procs) = rows(&v);
        println!("cluster seen from {}: {} nodes", v.node, v.nodes.len());
        print_table(NODE_COLUMNS, &nodes);
        println!();
        println!("{} processes under Ferry", v.processes.len());
        print_table(PROC_COLUMNS, &procs);
        if !v.unanswered.is_empty() {
            println!("did not answer: {}", v.unanswered.join(", "));
        }
        return Ok(());
    }
    let mut terminal = ratatui::try_init().context("set up the terminal (is this a terminal?)")?;
    let r = live(&mut terminal, &rt, node, first, a);
    ratatui::try_restore().context("restore the terminal")?;
    r
}

fn live(
    terminal: &mut ratatui::DefaultTerminal,
    rt: &tokio::runtime::Runtime,
    node: Option<&str>,
    first: ClusterView,
    a: Args,
) -> Result<()> {
    let interval = Duration::from_secs_f64(a.interval);
    let mut sort = a.sort;
    let mut view = first;
    let mut error: Option<String> = None;
    let mut next = Instant::now() + interval;
    loop {
        let shown = sorted(view.clone(), sort);
        terminal
            .draw(|f| draw(f, &shown, sort, error.as_deref()))
            .context("draw")?;
        let wait = next.saturating_duration_since(Instant::now());
        if event::poll(wait).context("read the terminal")? {
            match event::read().context("read the terminal")? {
                Event::Key(k) if k.kind == KeyEventKind::Press => match k.code {
                    KeyCode::Char('q') | KeyCode::Esc => return Ok(()),
                    KeyCode::Char('c') if k.modifiers.contains(KeyModifiers::CONTROL) => {
                        return Ok(())
                    }
                    KeyCode::Char('s') => sort = sort.next(),
                    _ => {}
                },
                _ => {}
            }
            continue;
        }
        match fetch(rt, node) {
            Ok(v) => {
                view = v;
                error = None;
            }
            Err(e) => error = Some(format!("{e:#}")),
        }
        next = Instant::now() + interval;
    }
}

fn pane<'a>(title: String, columns: &[&str], rows: &[Vec<String>]) -> Table<'a> {
    let w = widths(columns, rows);
    let last = w.len().saturating_sub(1);
    let constraints: Vec<Constraint> = w
        .iter()
        .enumerate()
        .map(|(i, &n)| {
            if i == last {
                Constraint::Min(n as u16)
            } else {
                Constraint::Length(n as u16)
            }
        })
        .collect();
    let header = Row::new(columns.iter().map(|c| c.to_string()))
        .style(Style::default().add_modifier(Modifier::BOLD | Modifier::REVERSED));
    Table::new(rows.iter().map(|r| Row::new(r.clone())), constraints)
        .header(header)
        .column_spacing(2)
        .block(Block::default().borders(Borders::ALL).title(title))
}

fn draw(f: &mut ratatui::Frame, v: &ClusterView, sort: Sort, error: Option<&str>) {
    let (nodes, procs) = rows(v);
    let [top, middle, bottom] = Layout::vertical([
        Constraint::Length(1),
        Constraint::Length(nodes.len() as u16 + 3),
        Constraint::Min(3),
    ])
    .areas(f.area());
    let mut status = format!(
        "ferry top: seen from {}, {} nodes, {} processes; sort: {} (s: change, q: quit)",
        v.node,
        v.nodes.len(),
        v.processes.len(),
        sort.name()
    );
    if !v.unanswered.is_empty() {
        status.push_str(&format!("; did not answer: {}", v.unanswered.join(", ")));
    }
    if let Some(e) = error {
        status.push_str(&format!("; {e}"));
    }
    f.render_widget(Paragraph::new(Line::from(status)), top);
    f.render_widget(pane("Nodes".into(), NODE_COLUMNS, &nodes), middle);
    f.render_widget(
        pane(format!("Processes ({})", sort.name()), PROC_COLUMNS, &procs),
        bottom,
    );
}
