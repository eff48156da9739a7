//! Every command's `--help` explains itself: a description for every option and argument,
//! at least one example (`Examples:` with a `locus …` line), and the options every command
//! shares under their own heading, apart from the command's own.

use clap::CommandFactory;

use super::Cli;

const SHARED: &str = "Connection and output (every command)";

/// Every command below `cmd`, with its path (`dataset import`), skipping clap's `help`.
fn walk(cmd: &clap::Command, path: &str, out: &mut Vec<(String, clap::Command)>) {
    for sub in cmd.get_subcommands().filter(|s| s.get_name() != "help") {
        let p = if path.is_empty() {
            sub.get_name().to_string()
        } else {
            format!("{path} {}", sub.get_name())
        };
        out.push((p.clone(), sub.clone()));
        walk(sub, &p, out);
    }
}

fn commands() -> Vec<(String, clap::Command)> {
    let mut root = Cli::command();
    root.build();
    let mut out = Vec::new();
    walk(&root, "", &mut out);
    out
}

#[test]
fn every_command_has_an_example_and_every_option_a_description() {
    let mut missing = Vec::new();
    let all = commands();
    assert!(all.len() > 40, "the walk found only {} commands", all.len());
    for (path, mut cmd) in all {
        if cmd.get_about().is_none() {
            missing.push(format!("{path}: no description"));
        }
        for a in cmd.get_arguments().filter(|a| !a.is_hide_set()) {
            let id = a.get_id().as_str();
            if id == "help" || id == "version" {
                continue;
            }
            if a.get_help().is_none_or(|h| h.to_string().trim().is_empty()) {
                missing.push(format!("{path}: {id} has no description"));
            }
        }
        let leaf = cmd.get_subcommands().next().is_none();
        let help = cmd.render_long_help().to_string();
        if leaf {
            let example = help
                .split_once("Examples:")
                .is_some_and(|(_, ex)| ex.lines().any(|l| l.trim_start().starts_with("locus ")));
            if !example {
                missing.push(format!("{path}: no example"));
            }
        }
        if help.contains("[default: \"\"]") {
            missing.push(format!("{path}: shows an empty default"));
        }
    }
    assert!(
        missing.is_empty(),
        "{} gaps:\n{}",
        missing.len(),
        missing.join("\n")
    );
}

#[test]
fn the_shared_options_have_their_own_heading_after_the_commands_own() {
    for (path, mut cmd) in commands() {
        let help = cmd.render_help().to_string();
        let Some(shared) = help.find(&format!("{SHARED}:")) else {
            panic!("{path}: no {SHARED:?} heading:\n{help}");
        };
        for flag in [
            "--metadata <URL>",
            "--token-file <FILE>",
            "--ca-cert <FILE>",
            "--json",
        ] {
            let at = help.find(flag).unwrap_or_else(|| panic!("{path}: no {flag}"));
            assert!(
                at > shared,
                "{path}: {flag} is among the command's own options:\n{help}"
            );
        }
        if let Some(own) = help.find("Options:") {
            assert!(own < shared, "{path}: its own options come first:\n{help}");
        }
    }
}
