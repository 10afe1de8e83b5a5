#!/usr/bin/env bash
# docs/tasks.md's shapes run as a user would, on the built-in model, each cut to one short step (what the trainer
# does with the data and rewards, not whether it learns):
#   bash tools/task_demo.sh [OUT]      (default OUT: results/tasks-demo; writes OUT/transcript.md)
# A conversational JSONL with a reward file; CSV and parquet files with another prompt column and two weighted
# rewards; a save_to_disk folder with a test split; one of TRL's reward functions unchanged; a reward that raises.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-results/tasks-demo}
WORK=$(mktemp -d)
mkdir -p "$OUT"
LOG="$OUT/transcript.md"
SHORT=(--steps 1 --prompts-per-step 2 --group-size 2 --max-new-tokens 24 --eval-size 2 --eval-k 2 --save-every 1)

python - "$WORK" <<'EOF'
import json, sys
from pathlib import Path

import datasets

work = Path(sys.argv[1])
system = {"role": "system", "content": "Answer with the number only, inside <answer></answer>."}
with open(work / "chat.jsonl", "w") as f:
    for i in range(8):
        prompt = [system, {"role": "user", "content": f"What is {i} + {i + 1}?"}]
        f.write(json.dumps({"prompt": prompt, "answer": str(2 * i + 1), "solution": f"${2 * i + 1}$"}) + "\n")
rows = {"question": [f"What is {i} times 2?" for i in range(8)], "answer": [str(2 * i) for i in range(8)]}
datasets.Dataset.from_dict(rows).to_csv(work / "table.csv", index=False)
datasets.Dataset.from_dict(rows).to_parquet(work / "table.parquet")
split = {k: v[:5] for k, v in rows.items()}, {k: v[5:] for k, v in rows.items()}
datasets.DatasetDict(
    {"train": datasets.Dataset.from_dict({"prompt": split[0]["question"], "answer": split[0]["answer"]}),
     "test": datasets.Dataset.from_dict({"prompt": split[1]["question"], "answer": split[1]["answer"]})}
).save_to_disk(work / "saved")
(work / "my_rewards.py").write_text('''
def exact_answer(prompts, completions, completion_ids, answer, **kwargs):
    """1 when the reply's <answer> block is exactly the row's answer."""
    import re
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    found = [re.findall(r"<answer>(.*?)</answer>", t, re.S) for t in texts]
    return [1.0 if f and f[-1].strip() == a else 0.0 for f, a in zip(found, answer)]


def brevity(completions, **kwargs):
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    return [max(0.0, 1 - len(t) / 100) for t in texts]


def broken(prompts, completions, completion_ids, answer, **kwargs):
    return [1.0 / (int(a) % 4) for a in answer]   # a division by zero on the rows whose answer is a multiple of 4
''')
EOF

run() {  # run TITLE -- gtpo-train arguments...: the command and the last lines it prints, into the transcript
    local title=$1; shift
    printf '\n## %s\n\n```\n$ gtpo-train %s\n' "$title" "$*" >> "$LOG"
    gtpo-train "$@" > "$WORK/out.txt" 2> "$WORK/err.txt"
    local status=$?
    { grep -v -e 'it/s' -e '^\s*$' "$WORK/out.txt" | tail -n 14; grep -v -e 'it/s\]' -e '^\s*$' "$WORK/err.txt" | tail -n 3
      echo "(exit status $status)"; echo '```'; } >> "$LOG"
}

printf '# gtpo-train on data and rewards of a user'"'"'s (%s)\n\n`bash tools/task_demo.sh`, on "%s", %s CPUs: each shape cut to one short step of the built-in model (the files are written by the script; what the trainer does with them, not whether it learns).\n' \
    "$(date +%F)" "$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)" "$(nproc)" > "$LOG"
export WANDB_MODE=offline
run "A conversational JSONL with a reward file" --dataset "$WORK/chat.jsonl" \
    --reward "$WORK/my_rewards.py:exact_answer" --reward "$WORK/my_rewards.py:brevity" --output-dir "$WORK/r1" "${SHORT[@]}"
run "A CSV file with another prompt column and two weighted rewards" --dataset "$WORK/table.csv" --prompt-column question \
    --system-prompt "Answer inside <answer></answer>." --reward correctness --reward "$WORK/my_rewards.py:brevity" \
    --reward-weights 1.0 0.25 --output-dir "$WORK/r2" "${SHORT[@]}"
run "The same as a parquet file" --dataset "$WORK/table.parquet" --prompt-column question \
    --system-prompt "Answer inside <answer></answer>." --reward correctness --reward "$WORK/my_rewards.py:brevity" \
    --reward-weights 1.0 0.25 --output-dir "$WORK/r3" "${SHORT[@]}"
run "A save_to_disk folder with a test split" --dataset "$WORK/saved" --eval-split test --eval-size 3 \
    --system-prompt "Answer inside <answer></answer>." --output-dir "$WORK/r4" "${SHORT[@]}"
run "One of TRL's reward functions, unchanged" --dataset "$WORK/chat.jsonl" --reward trl.rewards:accuracy_reward \
    --report-to tensorboard wandb trackio --output-dir "$WORK/r5" "${SHORT[@]}"
run "A reward that raises" --dataset "$WORK/table.csv" --prompt-column question --reward "$WORK/my_rewards.py:broken" \
    --output-dir "$WORK/r6" "${SHORT[@]}"
sed -i "s#$WORK#WORK#g" "$LOG"
echo "wrote $LOG"
rm -rf "$WORK"
