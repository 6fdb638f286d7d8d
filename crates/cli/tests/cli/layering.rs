//! The modules of each crate form no import cycle: module `a` that names
//! `crate::b` (outside comments and test code) depends on `b`, and no chain
//! of such dependencies leads back to where it started, so each module can
//! be read after the ones it uses.

use std::collections::{BTreeMap, BTreeSet};

use super::*;

/// The top-level module of each source file of `src` (`lib`/`main` left
/// out) and the modules of the crate it names.
fn dependencies(src: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let mut edges: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut files = vec![src.to_path_buf()];
    while let Some(path) = files.pop() {
        if path.is_dir() {
            files.extend(std::fs::read_dir(&path).unwrap().map(|e| e.unwrap().path()));
            continue;
        }
        if path.extension().is_none_or(|e| e != "rs") {
            continue;
        }
        let rel = path.strip_prefix(src).unwrap();
        let first = rel
            .components()
            .next()
            .unwrap()
            .as_os_str()
            .to_string_lossy();
        let module = first.trim_end_matches(".rs").to_string();
        if module == "lib" || module == "main" {
            continue;
        }
        let text = std::fs::read_to_string(&path).unwrap();
        let code = text.split("#[cfg(test)]").next().unwrap();
        let used = edges.entry(module.clone()).or_default();
        for line in code.lines().filter(|l| !l.trim_start().starts_with("//")) {
            for (i, _) in line.match_indices("crate::") {
                let rest = &line[i + "crate::".len()..];
                // `crate::a::...` and `crate::{a::x, b}` both name modules.
                let names: Vec<&str> = match rest.strip_prefix('{') {
                    Some(list) => list
                        .split(',')
                        .map(|p| p.trim().split("::").next().unwrap_or(""))
                        .collect(),
                    None => vec![
                        rest.split(|c: char| !c.is_alphanumeric() && c != '_')
                            .next()
                            .unwrap(),
                    ],
                };
                for name in names {
                    let name = name.trim_matches(|c: char| !c.is_alphanumeric() && c != '_');
                    if !name.is_empty() && name != module && name != "self" {
                        used.insert(name.to_string());
                    }
                }
            }
        }
    }
    edges
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

    for krate in ["model", "data", "train", "cli"] {
        let src = repo().join("crates").join(krate).join("src");
        let edges = dependencies(&src);
        assert!(edges.len() >= 3, "{krate}: modules found");
        if let Some(cycle) = find_cycle(&edges) {
            panic!("crates/{krate}: an import cycle: {}", cycle.join(" -> "));
        }
    }
}
