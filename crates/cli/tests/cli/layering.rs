//! The modules of each crate form no import cycle: module `a` that names
//! `crate::b` or `super::b` (outside comments and test code) depends on
//! `b`, a module of any depth (`crate::run::metrics` is a module of its
//! own), and no chain of such dependencies leads back to where it started,
//! so each module can be read after the ones it uses. Folders count as
//! modules too: `a::b` naming `c::d` also makes `a` depend on `c`, so no
//! two folders import each other either.

use std::collections::{BTreeMap, BTreeSet};

use super::*;

/// The module path of each source file of `src` (`a/b.rs` and
/// `a/b/mod.rs` are `a::b`; `lib`/`main` left out).
fn modules(src: &Path) -> BTreeMap<String, PathBuf> {
    let mut found = BTreeMap::new();
    let mut files = vec![src.to_path_buf()];
    while let Some(path) = files.pop() {
        if path.is_dir() {
            files.extend(std::fs::read_dir(&path).unwrap().map(|e| e.unwrap().path()));
            continue;
        }
        if path.extension().is_none_or(|e| e != "rs") {
            continue;
        }
        let rel = path.strip_prefix(src).unwrap().with_extension("");
        let mut parts: Vec<String> = rel
            .components()
            .map(|c| c.as_os_str().to_string_lossy().into_owned())
            .collect();
        if parts.last().is_some_and(|p| p == "mod") {
            parts.pop();
        }
        let module = parts.join("::");
        if module != "lib" && module != "main" {
            found.insert(module, path);
        }
    }
    found
}

/// The paths a line names through `crate::` or `super::`, made absolute
/// for code in `module` (`crate::{a::x, b}` names both).
fn named_paths(line: &str, module: &str) -> Vec<String> {
    let mut paths = vec![];
    for (root, resolve) in [("crate::", None), ("super::", Some(()))] {
        for (i, _) in line.match_indices(root) {
            if resolve.is_none() && line[..i].ends_with("super::") {
                continue;
            }
            let rest = &line[i + root.len()..];
            let prefix = match resolve {
                // The parent of the file's module: `super` of `a::b` is `a`.
                Some(()) => module.rsplit_once("::").map_or("", |(p, _)| p).to_string(),
                None => String::new(),
            };
            let join = |p: &str| {
                if prefix.is_empty() {
                    p.to_string()
                } else {
                    format!("{prefix}::{p}")
                }
            };
            match rest.strip_prefix('{') {
                Some(list) => {
                    let list = list.split('}').next().unwrap_or("");
                    paths.extend(list.split(',').map(|p| join(p.trim())));
                }
                None => {
                    let end = rest
                        .find(|c: char| !(c.is_alphanumeric() || c == '_' || c == ':'))
                        .unwrap_or(rest.len());
                    paths.push(join(&rest[..end]));
                }
            }
        }
    }
    paths
}

/// The names a crate root (`lib.rs`, `main.rs`) re-exports, each with the
/// module it comes from: `pub use a::{B, c::D};` maps `B` to `a` and `D`
/// to `a::c`.
fn reexports(root: &str) -> BTreeMap<String, String> {
    let mut found = BTreeMap::new();
    for statement in root.split("pub use ").skip(1) {
        let statement: String = statement
            .split(';')
            .next()
            .unwrap()
            .chars()
            .filter(|c| !c.is_whitespace())
            .collect();
        let (prefix, items) = match statement.split_once("::{") {
            Some((prefix, list)) => (prefix.to_string(), list.trim_end_matches('}').to_string()),
            None => match statement.rsplit_once("::") {
                Some((prefix, name)) => (prefix.to_string(), name.to_string()),
                None => continue,
            },
        };
        for item in items.split(',').filter(|i| !i.is_empty()) {
            let (module, name) = match item.rsplit_once("::") {
                Some((sub, name)) => (format!("{prefix}::{sub}"), name),
                None => (prefix.clone(), item),
            };
            found.insert(name.to_string(), module);
        }
    }
    found
}

/// Each module of `src` and the other modules it names (outside comments
/// and test code): a path names the longest module that begins it, a name
/// the crate root re-exports names the module it comes from, and a
/// module's own ancestors are left out (a child reads its parent's items).
fn dependencies(src: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let all = modules(src);
    let root = ["lib.rs", "main.rs"]
        .iter()
        .filter_map(|f| std::fs::read_to_string(src.join(f)).ok())
        .collect::<String>();
    let reexported = reexports(&root);
    let mut edges: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (module, path) in &all {
        let text = std::fs::read_to_string(path).unwrap();
        let code = text.split("#[cfg(test)]").next().unwrap();
        let used = edges.entry(module.clone()).or_default();
        for line in code.lines().filter(|l| !l.trim_start().starts_with("//")) {
            for named in named_paths(line, module) {
                let first = named.split("::").next().unwrap();
                let named = match reexported.get(first) {
                    Some(from) if !all.contains_key(first) => from.clone(),
                    _ => named,
                };
                let mut target = named.as_str();
                while !all.contains_key(target) {
                    match target.rsplit_once("::") {
                        Some((parent, _)) => target = parent,
                        None => break,
                    }
                }
                let ancestor = module.starts_with(&format!("{target}::"));
                if all.contains_key(target) && target != module && !ancestor {
                    used.insert(target.to_string());
                }
            }
        }
    }
    edges
}

/// The dependencies between the top-level modules (folders and files of
/// `src`) that the dependencies of their modules make.
fn folder_dependencies(
    edges: &BTreeMap<String, BTreeSet<String>>,
) -> BTreeMap<String, BTreeSet<String>> {
    let top = |m: &str| m.split("::").next().unwrap().to_string();
    let mut folders: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (from, to) in edges {
        let used = folders.entry(top(from)).or_default();
        used.extend(to.iter().map(|t| top(t)).filter(|t| *t != top(from)));
    }
    folders
}

/// A cycle through the dependencies, if any, as the modules along it.
fn find_cycle(edges: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    fn visit(
        m: &str,
        edges: &BTreeMap<String, BTreeSet<String>>,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(at) = path.iter().position(|p| p == m) {
            let mut cycle = path[at..].to_vec();
            cycle.push(m.to_string());
            return Some(cycle);
        }
        if !done.insert(m.to_string()) {
            return None;
        }
        path.push(m.to_string());
        for next in edges.get(m).into_iter().flatten() {
            if let Some(cycle) = visit(next, edges, path, done) {
                return Some(cycle);
            }
        }
        path.pop();
        None
    }
    let mut done = BTreeSet::new();
    edges
        .keys()
        .find_map(|m| visit(m, edges, &mut vec![], &mut done))
}

#[test]
fn no_module_of_any_crate_imports_one_that_imports_it_back() {
    // The checker itself finds a cycle.
    let mut made_up = BTreeMap::new();
    made_up.insert("a".to_string(), BTreeSet::from(["b".to_string()]));
    made_up.insert("b".to_string(), BTreeSet::from(["c".to_string()]));
    made_up.insert("c".to_string(), BTreeSet::from(["a".to_string()]));
    assert_eq!(find_cycle(&made_up).unwrap(), ["a", "b", "c", "a"]);

    // It follows the crate root's re-exports to the module behind a name.
    let names = reexports("pub use a::{B, c::D};\npub use e::F;\npub use g::{\n    H,\n};");
    let want = [("B", "a"), ("D", "a::c"), ("F", "e"), ("H", "g")];
    assert_eq!(
        names,
        want.map(|(n, m)| (n.to_string(), m.to_string())).into()
    );

    // It sees modules of any depth, through `crate::` and `super::` paths.
    let model = dependencies(&repo().join("crates/model/src"));
    assert!(model["attention::block"].contains("attention::scores"));
    assert!(model["gau"].contains("attention"));
    let train = dependencies(&repo().join("crates/train/src"));
    assert!(train["trainer"].contains("step::gradients"));
    assert!(
        !train["run"].contains("run::metrics"),
        "its own children are not edges back"
    );

    for krate in ["model", "data", "train", "cli"] {
        let src = repo().join("crates").join(krate).join("src");
        let edges = dependencies(&src);
        assert!(edges.len() >= 3, "{krate}: modules found");
        let folders = folder_dependencies(&edges);
        if let Some(cycle) = find_cycle(&edges) {
            panic!("crates/{krate}: an import cycle: {}", cycle.join(" -> "));
        }
        if let Some(cycle) = find_cycle(&folders) {
            panic!(
                "crates/{krate}: folders import each other: {}",
                cycle.join(" -> ")
            );
        }
    }
}
