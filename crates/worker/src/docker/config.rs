//! The container configuration of a stage: image, command, the SPEC 6 hardening, limits and
//! labels.

use std::collections::HashMap;

use super::{unix_now, OVERDUE_GRACE};
use crate::runtime::LABEL_DEADLINE;
use bollard::models::ContainerCreateBody as Config;
use bollard::models::{HostConfig, ResourcesUlimits};

use super::stage_network::stage_network_name;
use super::DockerRuntime;
use crate::runtime::StageSpec;

impl DockerRuntime {
    /// The container configuration for a stage: image, command, hardening, limits and labels.
    pub fn container_config(&self, spec: &StageSpec) -> Config {
        let mut labels = spec.labels.clone();
        labels.extend(self.owner_labels());
        // A container may be created while its run's repository is still being cloned, so
        // its deadline also covers the longest clone.
        let deadline = unix_now()
            + spec.timeout.as_secs()
            + OVERDUE_GRACE.as_secs()
            + crate::workspace::git::GIT_TIMEOUT.as_secs();
        labels.insert(LABEL_DEADLINE.into(), deadline.to_string());
        let binds = spec
            .mounts
            .iter()
            .map(|m| {
                format!(
                    "{}:{}:{}",
                    m.source.display(),
                    m.target,
                    if m.read_only { "ro" } else { "rw" }
                )
            })
            .collect();
        let memory = i64::try_from(spec.memory_bytes).unwrap_or(i64::MAX);
        Config {
            image: Some(spec.image.clone()),
            cmd: (!spec.command.is_empty()).then(|| spec.command.clone()),
            env: Some(spec.env.clone()),
            labels: Some(labels),
            user: spec.user.clone(),
            working_dir: spec.workdir.clone(),
            attach_stdout: Some(false),
            attach_stderr: Some(false),
            network_disabled: Some(spec.network == proto::Network::None && !spec.gateway),
            host_config: Some(HostConfig {
                binds: Some(binds),
                network_mode: Some(match spec.network {
                    // A stage with a provider reaches the gateway's relay, and nothing else,
                    // on its own network (an egress stage its proxy, there too).
                    proto::Network::None if spec.gateway => stage_network_name(&spec.name),
                    proto::Network::None => "none".to_string(),
                    proto::Network::Bridge => "bridge".to_string(),
                    proto::Network::Egress => stage_network_name(&spec.name),
                }),
                cap_drop: Some(vec!["ALL".to_string()]),
                security_opt: Some(vec!["no-new-privileges".to_string()]),
                pids_limit: Some(spec.pids_limit),
                memory: Some(memory),
                memory_swap: Some(memory),
                nano_cpus: Some((spec.cpus * 1e9) as i64),
                init: Some(true),
                readonly_rootfs: Some(spec.read_only_root),
                tmpfs: spec.read_only_root.then(|| {
                    HashMap::from([(
                        "/tmp".to_string(),
                        format!("rw,nosuid,nodev,size={},mode=1777", spec.disk_bytes),
                    )])
                }),
                ulimits: Some(stage_ulimits(spec)),
                ..Default::default()
            }),
            ..Default::default()
        }
    }
}

/// The resource limits of every stage's processes: open files, processes of the stage user,
/// the largest file it may write (its disk allowance), and no core dumps.
fn stage_ulimits(spec: &StageSpec) -> Vec<ResourcesUlimits> {
    let limit = |name: &str, value: i64| ResourcesUlimits {
        name: Some(name.to_string()),
        soft: Some(value),
        hard: Some(value),
    };
    vec![
        limit("nofile", STAGE_OPEN_FILES),
        limit("nproc", STAGE_PROCESSES),
        limit("fsize", i64::try_from(spec.disk_bytes).unwrap_or(i64::MAX)),
        limit("core", 0),
    ]
}

/// The open-files limit of a stage's processes.
const STAGE_OPEN_FILES: i64 = 4096;
/// The processes limit of the stage user (the container's pids limit is the tighter bound per
/// stage; this one counts every process of that user on the host).
const STAGE_PROCESSES: i64 = 8192;
