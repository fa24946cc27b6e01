//! `ferry make` on a real local cluster of separate nodes (a, b, c; b and c with their own host
//! names, PIDs and network, one shared tree): a small multi-file C program built with its
//! recipes run on b and c comes out right; a failing recipe fails make as it would locally, and
//! `-k` goes on with the rest; recipes printing many long lines at once never mix them, on
//! their nodes or when they all fall back to running here; and a
//! recipe whose node is killed while it runs is run again on the other node, the build carrying
//! on to success. The first three share one cluster; the last kills a node of its own cluster.

mod common;

use common::cluster::{Cluster, Isolation};
use libtest_mimic::{Arguments, Failed, Trial};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

fn main() {
    common::seal_inherited_fds();
    let args = Arguments::from_args();
    let cluster = if args.list {
        None
    } else {
        Some(Arc::new(Cluster::up_isolated(
            "make",
            3,
            Isolation::Separate,
        )))
    };
    type Test = fn(&Cluster) -> Result<(), Failed>;
    let tests: [(&str, Test); 3] = [
        ("builds_a_c_program_on_two_nodes", builds_a_c_program),
        ("failing_recipe_fails_make_as_locally", failing_recipe),
        ("output_lines_stay_whole", output_lines),
    ];
    let mut trials: Vec<Trial> = tests
        .into_iter()
        .map(|(name, f)| {
            let c = cluster.clone();
            Trial::test(name, move || match &c {
                Some(c) => f(c),
                None => Ok(()),
            })
        })
        .collect();
    for (name, how) in [
        (
            "recipe_on_a_killed_node_runs_again_elsewhere",
            Leaving::Killed,
        ),
        (
            "recipe_on_a_node_that_stops_taking_guests_runs_again_elsewhere",
            Leaving::Refusing,
        ),
    ] {
        trials.push(Trial::test(name, move || {
            if args_listing() {
                return Ok(());
            }
            node_leaves(how)
        }));
    }
    trials.push(Trial::test(
        "output_lines_stay_whole_when_recipes_run_here",
        || {
            if args_listing() {
                return Ok(());
            }
            output_lines_here()
        },
    ));
    let conclusion = libtest_mimic::run(&args, trials);
    drop(cluster);
    conclusion.exit();
}

fn args_listing() -> bool {
    std::env::args().any(|a| a == "--list")
}

fn check(ok: bool, what: impl FnOnce() -> String) -> Result<(), Failed> {
    if ok {
        Ok(())
    } else {
        Err(what().into())
    }
}

fn describe(o: &Output) -> String {
    format!(
        "{:?}\nstdout:\n{}\nstderr:\n{}",
        o.status,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// A fresh directory in the shared tree, which every node sees.
fn project(name: &str) -> PathBuf {
    let d = Cluster::shared_tree()
        .join("make")
        .join(format!("{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// `ferry make ARGS` on node a, in `dir`.
fn ferry_make(c: &Cluster, dir: &Path, args: &[&str]) -> Output {
    c.ferry("a")
        .arg("make")
        .args(args)
        .current_dir(dir)
        .stdin(Stdio::null())
        .output()
        .unwrap()
}

/// Eight source files and a main summing what they return; each compile says where it ran.
fn write_c_program(dir: &Path) {
    let mut decls = String::new();
    let mut sum = Vec::new();
    for i in 1..=8 {
        std::fs::write(
            dir.join(format!("f{i}.c")),
            format!("int f{i}(void) {{ return {i} * {i}; }}\n"),
        )
        .unwrap();
        decls.push_str(&format!("int f{i}(void);\n"));
        sum.push(format!("f{i}()"));
    }
    std::fs::write(
        dir.join("main.c"),
        format!(
            "#include <stdio.h>\n{decls}int main(void) {{ printf(\"sum %d\\n\", {}); return 0; }}\n",
            sum.join(" + ")
        ),
    )
    .unwrap();
    std::fs::write(
        dir.join("Makefile"),
        "OBJS = main.o f1.o f2.o f3.o f4.o f5.o f6.o f7.o f8.o\n\
         prog: $(OBJS)\n\tcc -o $@ $(OBJS)\n\
         %.o: %.c\n\t@echo \"compiled $< on $$(hostname)\"\n\tcc -c -o $@ $<\n",
    )
    .unwrap();
}

fn builds_a_c_program(c: &Cluster) -> Result<(), Failed> {
    let dir = project("c-program");
    write_c_program(&dir);
    let o = ferry_make(c, &dir, &["-j", "4", "--nodes", "b,c"]);
    check(o.status.success(), || {
        format!("ferry make: {}", describe(&o))
    })?;
    let out = String::from_utf8_lossy(&o.stdout);
    let hosts: Vec<&str> = out
        .lines()
        .filter_map(|l| l.strip_prefix("compiled "))
        .filter_map(|l| l.rsplit(" on ").next())
        .collect();
    check(hosts.len() == 9, || {
        format!("9 compiles expected: {}", describe(&o))
    })?;
    check(
        hosts.contains(&"b")
            && hosts.contains(&"c")
            && hosts.iter().all(|h| *h == "b" || *h == "c"),
        || {
            format!(
                "compiles ran on {hosts:?}, not on b and c: {}",
                describe(&o)
            )
        },
    )?;
    let run = Command::new(dir.join("prog")).output().unwrap();
    // 1 + 4 + 9 + ... + 64
    check(String::from_utf8_lossy(&run.stdout) == "sum 204\n", || {
        format!("the program built says {}", describe(&run))
    })?;
    // Up to date: make has nothing to do, as locally.
    let o = ferry_make(c, &dir, &["--nodes", "b,c"]);
    check(
        o.status.success() && String::from_utf8_lossy(&o.stdout).contains("up to date"),
        || format!("second ferry make: {}", describe(&o)),
    )?;
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

fn failing_recipe(c: &Cluster) -> Result<(), Failed> {
    let dir = project("failing");
    std::fs::write(
        dir.join("Makefile"),
        "all: bad good\n\
         bad:\n\t@echo failing on $$(hostname) >&2; exit 3\n\
         good:\n\tsleep 0.3; echo made > good\n",
    )
    .unwrap();
    let local = Command::new("make")
        .args(["-j2", "bad"])
        .current_dir(&dir)
        .output()
        .unwrap();
    let o = ferry_make(c, &dir, &["-j", "2", "--elsewhere", "bad"]);
    check(o.status.code() == local.status.code(), || {
        format!(
            "exit {:?} where make alone gives {:?}: {}",
            o.status.code(),
            local.status.code(),
            describe(&o)
        )
    })?;
    let err = String::from_utf8_lossy(&o.stderr);
    check(
        err.contains("Error 3") && (err.contains("failing on b") || err.contains("failing on c")),
        || format!("make's report of the failure: {}", describe(&o)),
    )?;
    // -k: the other target is still made.
    let o = ferry_make(c, &dir, &["-j", "1", "--elsewhere", "-k", "all"]);
    check(o.status.code() == Some(2), || {
        format!("-k: {}", describe(&o))
    })?;
    check(dir.join("good").exists(), || {
        format!("-k did not go on to make `good`: {}", describe(&o))
    })?;
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

fn output_lines(c: &Cluster) -> Result<(), Failed> {
    let dir = project("lines");
    let zeros = lines_makefile(&dir);
    let o = ferry_make(c, &dir, &["-j", "8"]);
    lines_stayed_whole(&o, &zeros)?;
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

/// The same with no node taking guests: every recipe falls back to running here, beside the
/// others.
fn output_lines_here() -> Result<(), Failed> {
    let c = Cluster::up_isolated("make-here", 1, Isolation::Separate);
    let o = c.run("a", &["accept", "no"]);
    check(o.status.success(), || {
        format!("accept no: {}", describe(&o))
    })?;
    let dir = project("lines-here");
    let zeros = lines_makefile(&dir);
    let o = ferry_make(&c, &dir, &["-j", "8"]);
    check(
        String::from_utf8_lossy(&o.stderr).contains("recipes run here"),
        || format!("the recipes did not fall back to here: {}", describe(&o)),
    )?;
    lines_stayed_whole(&o, &zeros)?;
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

/// A Makefile of eight recipes at once, each 2000 lines of ~200 bytes (400 KB, several times a
/// pipe's capacity: every recipe's output goes out in many partial writes), written by awk in
/// blocks of 4 KiB that cut lines anywhere. Returns the lines' filler.
fn lines_makefile(dir: &Path) -> String {
    let zeros = "0".repeat(180);
    let mut mk = String::from("all: r1 r2 r3 r4 r5 r6 r7 r8\n");
    for r in 1..=8 {
        mk.push_str(&format!(
            "r{r}:\n\t@awk 'BEGIN {{ for (i = 1; i <= 2000; i++) \
             printf \"recipe {r} line %d {zeros} end\\n\", i }}'\n"
        ));
    }
    std::fs::write(dir.join("Makefile"), mk).unwrap();
    zeros
}

/// Every line of `o` whole, and all 16000 there.
fn lines_stayed_whole(o: &Output, zeros: &str) -> Result<(), Failed> {
    check(o.status.success(), || {
        format!("ferry make: {}", describe(o))
    })?;
    let out = String::from_utf8_lossy(&o.stdout);
    let mut seen = std::collections::HashSet::new();
    for l in out.lines() {
        let mut w = l.split(' ');
        let ok = w.next() == Some("recipe")
            && w.next().and_then(|r| r.parse::<u32>().ok()).is_some()
            && w.next() == Some("line")
            && w.next().and_then(|r| r.parse::<u32>().ok()).is_some()
            && w.next() == Some(zeros)
            && w.next() == Some("end")
            && w.next().is_none();
        check(ok, || format!("a broken line: {l:?}"))?;
        seen.insert(l.to_string());
    }
    check(seen.len() == 8 * 2000, || {
        format!("{} distinct lines, not 16000", seen.len())
    })
}

#[derive(Clone, Copy, PartialEq)]
enum Leaving {
    /// The node is killed outright (its init, hence everything on it).
    Killed,
    /// The node stops taking guests (`ferry accept no` there: an owner taking it back).
    Refusing,
}

fn node_leaves(how: Leaving) -> Result<(), Failed> {
    let tag = match how {
        Leaving::Killed => "make-kill",
        Leaving::Refusing => "make-refuse",
    };
    let c = Cluster::up_isolated(tag, 3, Isolation::Separate);
    let dir = project(tag);
    // One recipe: it says where it started, works a while, then says where it finished.
    std::fs::write(
        dir.join("Makefile"),
        "done.txt:\n\thostname >> started.txt; sleep 3; hostname > done.txt\n",
    )
    .unwrap();
    let mut make = c
        .ferry("a")
        .args(["make", "--nodes", "b,c"])
        .current_dir(&dir)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let started = dir.join("started.txt");
    let mut first = String::new();
    let o = match make_with_a_node_leaving(&c, how, &mut make, &started, &mut first) {
        Ok(()) => make.wait_with_output().unwrap(),
        Err(e) => {
            let _ = make.kill();
            let _ = make.wait();
            return Err(e);
        }
    };
    check(o.status.success(), || {
        format!("ferry make after node {first} died: {}", describe(&o))
    })?;
    let done = std::fs::read_to_string(dir.join("done.txt")).unwrap_or_default();
    let other = if first == "b" { "c" } else { "b" };
    check(done.trim() == other, || {
        format!(
            "done.txt says {done:?} (started on {first}, then {:?}): {}",
            std::fs::read_to_string(&started).unwrap_or_default(),
            describe(&o)
        )
    })?;
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

/// Waits for the recipe to start on some node (named in `first`), makes that node leave, and
/// waits for `ferry make` to end.
fn make_with_a_node_leaving(
    c: &Cluster,
    how: Leaving,
    make: &mut std::process::Child,
    started: &Path,
    first: &mut String,
) -> Result<(), Failed> {
    let deadline = Instant::now() + Duration::from_secs(20);
    *first = loop {
        if let Ok(s) = std::fs::read_to_string(started) {
            if let Some(l) = s.lines().next() {
                break l.to_string();
            }
        }
        if Instant::now() > deadline {
            return Err("the recipe never started".into());
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let victim = c
        .init_pid(first)
        .ok_or_else(|| format!("the recipe started on {first:?}, not a separate node"))?;
    if how == Leaving::Killed {
        // The node goes as a machine whose power is cut: everything on it, daemon and recipe.
        let _ = Command::new("kill")
            .args(["-9", &victim.to_string()])
            .status();
    } else {
        let o = c.run(first, &["accept", "no"]);
        check(o.status.success(), || {
            format!("accept no: {}", describe(&o))
        })?;
    }
    let t = Instant::now();
    while make.try_wait().unwrap().is_none() {
        if t.elapsed() > Duration::from_secs(40) {
            return Err(format!("ferry make still running 40 s after node {first} left").into());
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    Ok(())
}
