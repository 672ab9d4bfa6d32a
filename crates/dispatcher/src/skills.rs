//! Skill resolution and `review.md` parsing (SPEC 3).
//!
//! Each file is resolved on its own: `{project}/{skill}/FILE` if it exists, else
//! `default/{skill}/FILE`. An override replaces the default completely. The frontmatter is
//! optional YAML; every problem in it becomes a warning that names the file and the key, and the
//! next source in the priority chain is used.
//!
//! Names are exact, and a symbolic link that leads out of the skills folder is refused.
//! `max_retries` is the first of: the frontmatter, `AUTO_REVIEW_MAX_RETRIES`, 3. The frontmatter
//! wins over the environment, as the priority chain says, so `AUTO_REVIEW_MAX_RETRIES=0` turns
//! review off for every skill that does not set `max_retries` itself.

use std::path::Path;

use yaml_rust2::{Yaml, YamlLoader};

use crate::SubmitError;

/// The largest `max_retries` a `review.md` or `AUTO_REVIEW_MAX_RETRIES` may set.
pub const MAX_REVIEW_CYCLES: i64 = 20;
/// The reviewer stage's time limit when `review.md` sets none.
pub const DEFAULT_REVIEW_TIMEOUT_SECONDS: u64 = 300;
/// The retry limit when neither the frontmatter nor the environment sets one.
pub const DEFAULT_MAX_RETRIES: u32 = 3;

/// A file found in the skills directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SkillFile {
    /// The path relative to the skills directory, `myproject/implement-task/review.md`.
    pub relative: String,
    /// The file's text.
    pub text: String,
}

/// Finds `FILE` for a skill: the project override first, then the default.
///
/// Only the exact file name counts (a `Review.md` is not a `review.md`, even on a
/// case-insensitive file system), and a path that resolves outside the skills directory
/// (through a symlink) is refused.
pub fn resolve(
    skills_dir: &Path,
    project: &str,
    skill: &str,
    file: &str,
) -> Result<Option<SkillFile>, SubmitError> {
    let root = skills_dir
        .canonicalize()
        .map_err(|source| SubmitError::Io {
            path: skills_dir.to_path_buf(),
            source,
        })?;
    for folder in [project, "default"] {
        let dir = root.join(folder).join(skill);
        if !has_exact_entry(&dir, file) {
            continue;
        }
        let path = dir.join(file);
        let real = path.canonicalize().map_err(|source| SubmitError::Io {
            path: path.clone(),
            source,
        })?;
        if !real.starts_with(&root) {
            return Err(SubmitError::invalid(
                "skill",
                "skill files must stay inside the skills directory (no symlink escapes)",
                &path.display().to_string(),
            ));
        }
        let text = std::fs::read_to_string(&real).map_err(|source| SubmitError::Io {
            path: path.clone(),
            source,
        })?;
        return Ok(Some(SkillFile {
            relative: format!("{folder}/{skill}/{file}"),
            text,
        }));
    }
    Ok(None)
}

/// The parsed `review.md`: its body and whichever frontmatter keys were valid.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReviewFile {
    /// Everything after the closing `---`, or the whole file without frontmatter.
    pub body: String,
    /// `max_retries`, when present and an integer in 0..=20.
    pub max_retries: Option<u32>,
    /// `block_on_failure`, when present and a boolean.
    pub block_on_failure: Option<bool>,
    /// `timeout_seconds`, when present and a positive integer.
    pub timeout_seconds: Option<u64>,
}

/// Parses a `review.md`, returning the file and the warnings it raised. `path` names the file in
/// warnings.
pub fn parse_review(text: &str, path: &str) -> (ReviewFile, Vec<String>) {
    let mut warnings = Vec::new();
    let Some((front, body)) = split_frontmatter(text) else {
        return (
            ReviewFile {
                body: text.to_string(),
                ..ReviewFile::default()
            },
            warnings,
        );
    };
    let mut review = ReviewFile {
        body: body.to_string(),
        ..ReviewFile::default()
    };
    let mapping = match YamlLoader::load_from_str(front) {
        Ok(documents) => match documents.into_iter().next() {
            None | Some(Yaml::Null) => return (review, warnings),
            Some(Yaml::Hash(mapping)) => mapping,
            Some(_) => {
                warnings.push(format!(
                    "Malformed YAML in {path}: the frontmatter must be a mapping of keys to values; every key takes its default"
                ));
                return (review, warnings);
            }
        },
        Err(error) => {
            warnings.push(format!(
                "Malformed YAML in {path}: {error}; every key takes its default"
            ));
            return (review, warnings);
        }
    };
    for (key, value) in mapping {
        let Some(key) = key.as_str() else {
            warnings.push(format!(
                "{path}: frontmatter key {key:?} is not a string; ignored"
            ));
            continue;
        };
        match key {
            "max_retries" => match value {
                Yaml::Integer(n) if (0..=MAX_REVIEW_CYCLES).contains(&n) => review.max_retries = Some(n as u32),
                other => warnings.push(format!(
                    "{path}: max_retries must be an integer from 0 to {MAX_REVIEW_CYCLES}, got {}; ignored, the next source is used",
                    describe(&other)
                )),
            },
            "block_on_failure" => match value {
                Yaml::Boolean(b) => review.block_on_failure = Some(b),
                other => warnings.push(format!(
                    "{path}: block_on_failure must be true or false, got {}; ignored, the default false is used",
                    describe(&other)
                )),
            },
            "timeout_seconds" => match value {
                Yaml::Integer(n) if n > 0 => review.timeout_seconds = Some(n as u64),
                other => warnings.push(format!(
                    "{path}: timeout_seconds must be a positive integer, got {}; ignored, the default {DEFAULT_REVIEW_TIMEOUT_SECONDS} is used",
                    describe(&other)
                )),
            },
            unknown => warnings.push(format!("{path}: unknown frontmatter key `{unknown}` ignored")),
        }
    }
    (review, warnings)
}

/// Resolves `max_retries` through the priority chain: frontmatter, `AUTO_REVIEW_MAX_RETRIES`, 3.
pub fn resolve_max_retries(
    frontmatter: Option<u32>,
    env_value: Option<&str>,
    warnings: &mut Vec<String>,
) -> u32 {
    if let Some(n) = frontmatter {
        return n;
    }
    if let Some(raw) = env_value {
        match raw.trim().parse::<i64>() {
            Ok(n) if (0..=MAX_REVIEW_CYCLES).contains(&n) => return n as u32,
            _ => warnings.push(format!(
                "AUTO_REVIEW_MAX_RETRIES must be an integer from 0 to {MAX_REVIEW_CYCLES}, got {raw:?}; ignored, the default {DEFAULT_MAX_RETRIES} is used"
            )),
        }
    }
    DEFAULT_MAX_RETRIES
}

/// Splits `---\n{front}\n---\n{body}`; `None` when line 1 is not exactly `---` or no later line is.
fn split_frontmatter(text: &str) -> Option<(&str, &str)> {
    let mut lines = text.split_inclusive('\n');
    let first = lines.next()?;
    if strip_eol(first) != "---" {
        return None;
    }
    let front_start = first.len();
    let mut offset = front_start;
    for line in lines {
        if strip_eol(line) == "---" {
            return Some((&text[front_start..offset], &text[offset + line.len()..]));
        }
        offset += line.len();
    }
    None
}

fn strip_eol(line: &str) -> &str {
    let line = line.strip_suffix('\n').unwrap_or(line);
    line.strip_suffix('\r').unwrap_or(line)
}

fn has_exact_entry(dir: &Path, name: &str) -> bool {
    std::fs::read_dir(dir)
        .map(|entries| entries.flatten().any(|e| e.file_name() == name))
        .unwrap_or(false)
}

fn describe(value: &Yaml) -> String {
    match value {
        Yaml::Integer(n) => n.to_string(),
        Yaml::Real(r) => r.clone(),
        Yaml::String(s) => format!("the string {s:?}"),
        Yaml::Boolean(b) => b.to_string(),
        Yaml::Null => "nothing".to_string(),
        Yaml::Array(_) => "a list".to_string(),
        Yaml::Hash(_) => "a mapping".to_string(),
        _ => "an unsupported value".to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> (ReviewFile, Vec<String>) {
        parse_review(text, "default/implement-task/review.md")
    }

    #[test]
    fn frontmatter_cases() {
        struct Case {
            text: &'static str,
            max_retries: Option<u32>,
            block: Option<bool>,
            body: &'static str,
            warning: Option<&'static str>,
        }
        let cases = [
            Case {
                text: "---\nmax_retries: 5\n---\n# Check\n",
                max_retries: Some(5),
                block: None,
                body: "# Check\n",
                warning: None,
            },
            Case {
                text: "---\nmax_retries: 0\nblock_on_failure: true\n---\nB",
                max_retries: Some(0),
                block: Some(true),
                body: "B",
                warning: None,
            },
            Case {
                text: "# No frontmatter\nmax_retries: 5\n",
                max_retries: None,
                block: None,
                body: "# No frontmatter\nmax_retries: 5\n",
                warning: None,
            },
            Case {
                text: " ---\nmax_retries: 5\n---\nB",
                max_retries: None,
                block: None,
                body: " ---\nmax_retries: 5\n---\nB",
                warning: None,
            },
            Case {
                text: "---\nmax_retries: 5\nno closing line\n",
                max_retries: None,
                block: None,
                body: "---\nmax_retries: 5\nno closing line\n",
                warning: None,
            },
            Case {
                text: "---\nmax_retries: \"3\"\n---\nB",
                max_retries: None,
                block: None,
                body: "B",
                warning: Some("max_retries must be an integer"),
            },
            Case {
                text: "---\nmax_retries: three\n---\nB",
                max_retries: None,
                block: None,
                body: "B",
                warning: Some("the string \"three\""),
            },
            Case {
                text: "---\nmax_retries: -1\n---\nB",
                max_retries: None,
                block: None,
                body: "B",
                warning: Some("got -1"),
            },
            Case {
                text: "---\nmax_retries: 21\n---\nB",
                max_retries: None,
                block: None,
                body: "B",
                warning: Some("got 21"),
            },
            Case {
                text: "---\nmax_retries: 2.5\n---\nB",
                max_retries: None,
                block: None,
                body: "B",
                warning: Some("got 2.5"),
            },
            Case {
                text: "---\nblock_on_failure: yes please\n---\nB",
                max_retries: None,
                block: None,
                body: "B",
                warning: Some("block_on_failure must be true or false"),
            },
            Case {
                text: "---\nmax_retries: [1\n---\nBody after\n",
                max_retries: None,
                block: None,
                body: "Body after\n",
                warning: Some("Malformed YAML in default/implement-task/review.md"),
            },
            Case {
                text: "---\njust a string\n---\nB",
                max_retries: None,
                block: None,
                body: "B",
                warning: Some("Malformed YAML"),
            },
            Case {
                text: "---\ncolour: blue\nmax_retries: 2\n---\nB",
                max_retries: Some(2),
                block: None,
                body: "B",
                warning: Some("unknown frontmatter key `colour`"),
            },
            Case {
                text: "---\n---\nB",
                max_retries: None,
                block: None,
                body: "B",
                warning: None,
            },
            Case {
                text: "---\r\nmax_retries: 4\r\n---\r\nB",
                max_retries: Some(4),
                block: None,
                body: "B",
                warning: None,
            },
        ];
        for case in cases {
            let (review, warnings) = parse(case.text);
            assert_eq!(
                review.max_retries, case.max_retries,
                "max_retries of {:?}",
                case.text
            );
            assert_eq!(
                review.block_on_failure, case.block,
                "block of {:?}",
                case.text
            );
            assert_eq!(review.body, case.body, "body of {:?}", case.text);
            match case.warning {
                None => assert!(
                    warnings.is_empty(),
                    "unexpected warnings {warnings:?} for {:?}",
                    case.text
                ),
                Some(expected) => {
                    assert_eq!(
                        warnings.len(),
                        1,
                        "warnings {warnings:?} for {:?}",
                        case.text
                    );
                    assert!(
                        warnings[0].contains(expected),
                        "{:?} lacks {expected:?}",
                        warnings[0]
                    );
                    assert!(
                        warnings[0].contains("default/implement-task/review.md"),
                        "{:?} names no file",
                        warnings[0]
                    );
                }
            }
        }
    }

    #[test]
    fn wrong_types_name_the_key() {
        let (_, warnings) = parse("---\nmax_retries: \"3\"\n---\nB");
        assert!(warnings[0].contains("max_retries"));
    }

    #[test]
    fn max_retries_priority_chain() {
        let cases: [(Option<u32>, Option<&str>, u32, bool); 7] = [
            (Some(5), Some("7"), 5, false),
            (Some(0), Some("7"), 0, false),
            (None, Some("7"), 7, false),
            (None, Some("0"), 0, false),
            (None, None, 3, false),
            (None, Some("many"), 3, true),
            (None, Some("-2"), 3, true),
        ];
        for (front, env, expected, warns) in cases {
            let mut warnings = Vec::new();
            assert_eq!(
                resolve_max_retries(front, env, &mut warnings),
                expected,
                "{front:?} {env:?}"
            );
            assert_eq!(
                !warnings.is_empty(),
                warns,
                "{front:?} {env:?}: {warnings:?}"
            );
            if warns {
                assert!(warnings[0].contains("AUTO_REVIEW_MAX_RETRIES"));
            }
        }
    }

    #[test]
    fn overrides_replace_defaults_file_by_file() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        std::fs::create_dir_all(root.join("default/implement-task")).unwrap();
        std::fs::create_dir_all(root.join("myproject/implement-task")).unwrap();
        std::fs::write(
            root.join("default/implement-task/SKILL.md"),
            "default skill",
        )
        .unwrap();
        std::fs::write(
            root.join("default/implement-task/review.md"),
            "default review",
        )
        .unwrap();
        std::fs::write(
            root.join("myproject/implement-task/review.md"),
            "project review",
        )
        .unwrap();

        let skill = resolve(root, "myproject", "implement-task", "SKILL.md")
            .unwrap()
            .unwrap();
        assert_eq!(skill.text, "default skill");
        let review = resolve(root, "myproject", "implement-task", "review.md")
            .unwrap()
            .unwrap();
        assert_eq!(review.text, "project review");
        assert_eq!(review.relative, "myproject/implement-task/review.md");
        let other = resolve(root, "other", "implement-task", "review.md")
            .unwrap()
            .unwrap();
        assert_eq!(other.text, "default review");
        assert_eq!(
            resolve(root, "myproject", "missing", "SKILL.md").unwrap(),
            None
        );
    }

    #[test]
    fn only_lowercase_review_md_counts() {
        let dir = tempfile::tempdir().unwrap();
        let skill = dir.path().join("default/s");
        std::fs::create_dir_all(&skill).unwrap();
        std::fs::write(skill.join("Review.md"), "wrong case").unwrap();
        assert_eq!(resolve(dir.path(), "p", "s", "review.md").unwrap(), None);
    }

    #[test]
    fn symlink_escapes_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let outside = tempfile::tempdir().unwrap();
        std::fs::write(outside.path().join("secret.md"), "outside").unwrap();
        let skill = dir.path().join("default/s");
        std::fs::create_dir_all(&skill).unwrap();
        std::os::unix::fs::symlink(outside.path().join("secret.md"), skill.join("SKILL.md"))
            .unwrap();
        let error = resolve(dir.path(), "p", "s", "SKILL.md").unwrap_err();
        assert!(
            error.to_string().contains("inside the skills directory"),
            "{error}"
        );
    }

    mod properties {
        use super::super::*;
        use proptest::prelude::*;

        proptest! {
            #[test]
            fn any_review_md_parses_or_warns(text in "\\PC{0,600}") {
                let (file, _warnings) = parse_review(&text, "default/s/review.md");
                prop_assert!(file.max_retries.is_none_or(|n| n <= 20));
            }

            #[test]
            fn frontmatter_values_are_read_exactly(
                retries in 0u32..40,
                block in any::<bool>(),
                body in "[a-zA-Z .\n]{0,200}",
            ) {
                let text = format!("---\nmax_retries: {retries}\nblock_on_failure: {block}\n---\n{body}");
                let (file, warnings) = parse_review(&text, "default/s/review.md");
                if retries <= 20 {
                    prop_assert_eq!(file.max_retries, Some(retries));
                    prop_assert!(warnings.is_empty(), "{:?}", warnings);
                } else {
                    prop_assert_eq!(file.max_retries, None);
                    prop_assert!(!warnings.is_empty());
                }
                prop_assert_eq!(file.block_on_failure, Some(block));
            }
        }
    }
}
