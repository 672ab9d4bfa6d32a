"""Setup shared by the benchmark and soak scripts: a skills folder with one reviewed skill and
an agents file with an implementer and a reviewer profile."""
import json
import os


def write_skill_and_agents(work, image, implement, review, limits='memory = "128m"\ncpus = 0.5\n'):
    """Writes `{work}/skills/default/implement-task` (SKILL.md, review.md with one retry) and
    `{work}/agents.toml` (profiles `i` and `r` running `implement` and `review` in `image`);
    returns (skills folder, agents file)."""
    skills = os.path.join(work, "skills")
    skill = os.path.join(skills, "default", "implement-task")
    os.makedirs(skill)
    with open(os.path.join(skill, "SKILL.md"), "w") as f:
        f.write("# Implement\n")
    with open(os.path.join(skill, "review.md"), "w") as f:
        f.write("---\nmax_retries: 1\n---\nCheck.\n")
    agents = os.path.join(work, "agents.toml")
    with open(agents, "w") as f:
        f.write("[defaults]\nimplementer = \"i\"\nreviewer = \"r\"\n"
                f"[agents.i]\nimage = \"{image}\"\ncommand = {json.dumps(implement)}\n{limits}"
                f"[agents.r]\nimage = \"{image}\"\ncommand = {json.dumps(review)}\n{limits}")
    return skills, agents
