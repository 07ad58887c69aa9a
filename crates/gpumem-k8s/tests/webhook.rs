//! The webhook's HTTP handler fed real AdmissionReview v1 JSON — a Deployment's pod, a Job's pod,
//! bad annotations, a pod without any — for each sharing system; the JSON patch it answers is
//! applied to the pod and the result checked.

use std::sync::Arc;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use base64::Engine;
use gpumem_k8s::{Sharing, Webhook};
use serde_json::{Value, json};
use tower::ServiceExt;

fn fixture(name: &str) -> Value {
    serde_json::from_str(
        &std::fs::read_to_string(format!("{}/tests/data/{name}", env!("CARGO_MANIFEST_DIR")))
            .unwrap(),
    )
    .unwrap()
}

/// POSTs `review` to /mutate; the answer's status and body.
fn post(hook: &Arc<Webhook>, review: &Value) -> (StatusCode, Value) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let req = Request::post("/mutate")
            .header("content-type", "application/json")
            .body(Body::from(review.to_string()))
            .unwrap();
        let res = hook.clone().router().oneshot(req).await.unwrap();
        let status = res.status();
        let bytes = axum::body::to_bytes(res.into_body(), 1 << 20)
            .await
            .unwrap();
        (status, serde_json::from_slice(&bytes).unwrap())
    })
}

/// The pod after the answer's patch (and the answer's warnings).
fn admitted(hook: &Arc<Webhook>, review: &Value) -> (Value, Vec<String>) {
    let (status, answer) = post(hook, review);
    assert_eq!(status, StatusCode::OK, "{answer}");
    let response = &answer["response"];
    assert_eq!(response["uid"], review["request"]["uid"]);
    assert_eq!(response["allowed"], true, "never blocks a pod: {answer}");
    let mut pod = review["request"]["object"].clone();
    // kube-core writes the patch's bytes as a JSON array (Go's decoder takes that or base64).
    let bytes: Option<Vec<u8>> = match &response["patch"] {
        Value::String(b64) => Some(
            base64::engine::general_purpose::STANDARD
                .decode(b64)
                .unwrap(),
        ),
        Value::Array(a) => Some(a.iter().map(|b| b.as_u64().unwrap() as u8).collect()),
        _ => None,
    };
    if let Some(bytes) = bytes {
        assert_eq!(response["patchType"], "JSONPatch");
        let ops: json_patch::Patch = serde_json::from_slice(&bytes).unwrap();
        json_patch::patch(&mut pod, &ops).unwrap();
    }
    let warnings = response["warnings"]
        .as_array()
        .map(|w| w.iter().map(|s| s.as_str().unwrap().to_string()).collect())
        .unwrap_or_default();
    (pod, warnings)
}

fn hook(sharing: Sharing) -> Arc<Webhook> {
    Arc::new(Webhook::new(sharing, "a100-40gb").unwrap())
}

/// gpumem's upper bound of an MLP job, MiB, as `gpumem estimate` computes it.
fn upper_bound_mib(model: &str, batch: u64, optimizer: &str, gpu: &str) -> u64 {
    let profile = gpumem_core::profile::builtin(gpu).unwrap();
    let options = gpumem_core::job::OptionValues {
        optimizer: gpumem_core::job::Optimizer::parse(optimizer).unwrap(),
        ..Default::default()
    }
    .check()
    .unwrap();
    let trace = gpumem_workload::Workload::parse(model, batch, options)
        .unwrap()
        .trace(&profile)
        .unwrap();
    gpumem_core::estimate::by_name("replay")
        .unwrap()
        .estimate(&trace, &profile)
        .unwrap()
        .upper_bound_bytes
        .div_ceil(1 << 20)
}

#[test]
fn hami_gets_gpu_and_gpumem_limits_on_the_first_container() {
    let hook = hook(Sharing::Hami);
    let (pod, warnings) = admitted(&hook, &fixture("deployment-pod.json"));
    assert!(warnings.is_empty(), "{warnings:?}");
    let limits = &pod["spec"]["containers"][0]["resources"]["limits"];
    assert_eq!(limits["nvidia.com/gpu"], "1");
    let mib: u64 = limits["nvidia.com/gpumem"]
        .as_str()
        .unwrap()
        .parse()
        .unwrap();
    let notes = &pod["metadata"]["annotations"];
    assert_eq!(
        notes["gpumem.io/upper-bound-mib"].as_str().unwrap(),
        mib.to_string()
    );
    assert!(
        notes["gpumem.io/estimate-mib"]
            .as_str()
            .unwrap()
            .parse::<f64>()
            .unwrap()
            < mib as f64
    );
    assert_eq!(
        mib,
        upper_bound_mib(
            "mlp:input=4096,output=10,depth=4",
            256,
            "adamw",
            "a100-80gb"
        )
    );
    assert_eq!(
        pod["spec"]["containers"][0]["resources"]["requests"]["cpu"], "4",
        "what was there stays"
    );
    assert!(
        pod["spec"]["containers"][1].get("resources").is_none(),
        "only the first container"
    );
}

#[test]
fn volcano_gets_vgpu_limits_on_the_named_container_keeping_its_gpu_count() {
    let hook = hook(Sharing::Volcano);
    let (pod, warnings) = admitted(&hook, &fixture("job-pod.json"));
    assert!(warnings.is_empty(), "{warnings:?}");
    let worker = &pod["spec"]["containers"][1]["resources"]["limits"];
    assert_eq!(worker["volcano.sh/vgpu-number"], "1");
    assert!(
        worker["volcano.sh/vgpu-memory"]
            .as_str()
            .unwrap()
            .parse::<u64>()
            .unwrap()
            > 1000
    );
    assert_eq!(worker["cpu"], "8");
    assert!(pod["spec"]["containers"][0].get("resources").is_none());
    // HAMi keeps the GPU count the pod asked for and adds only the memory.
    let (pod, _) = admitted(&self::hook(Sharing::Hami), &fixture("job-pod.json"));
    let worker = &pod["spec"]["containers"][1]["resources"]["limits"];
    assert_eq!(worker["nvidia.com/gpu"], "1");
    assert!(worker["nvidia.com/gpumem"].is_string());
}

#[test]
fn kai_gets_the_gpu_memory_annotation() {
    let (pod, warnings) = admitted(&hook(Sharing::Kai), &fixture("deployment-pod.json"));
    assert!(warnings.is_empty());
    let notes = &pod["metadata"]["annotations"];
    assert_eq!(notes["gpu-memory"], notes["gpumem.io/upper-bound-mib"]);
    assert!(
        pod["spec"]["containers"][0]["resources"]
            .get("limits")
            .is_none(),
        "KAI reads the annotation, not limits"
    );
}

#[test]
fn bad_annotations_never_block_a_pod() {
    let hook = hook(Sharing::Hami);
    let base = fixture("deployment-pod.json");
    let with = |key: &str, value: Value| {
        let mut r = base.clone();
        r["request"]["object"]["metadata"]["annotations"][key] = value;
        r
    };
    for (review, needle) in [
        (
            with("gpumem.io/batch", json!("lots")),
            "gpumem.io/batch: `lots` is not a whole number",
        ),
        (
            with("gpumem.io/model", json!("mlp:depth=x")),
            "gpumem.io/model",
        ),
        (with("gpumem.io/gpu", json!("b300")), "unknown GPU `b300`"),
        (
            with("gpumem.io/precision", json!("fp7")),
            "gpumem.io/precision",
        ),
        (
            with("gpumem.io/container", json!("nope")),
            "no container `nope`",
        ),
        (with("gpumem.io/batch", json!("4000000")), "exceeds one"),
    ] {
        let (pod, warnings) = admitted(&hook, &review);
        assert_eq!(pod, review["request"]["object"], "unchanged");
        assert!(
            warnings.len() == 1
                && warnings[0].contains(needle)
                && warnings[0].ends_with("the pod is admitted unchanged"),
            "{needle}: {warnings:?}"
        );
    }
    // No gpumem annotation: untouched, no warning.
    let mut plain = base.clone();
    plain["request"]["object"]["metadata"]["annotations"] = json!({});
    let (pod, warnings) = admitted(&hook, &plain);
    assert!(pod == plain["request"]["object"] && warnings.is_empty());
    // Not an AdmissionReview at all: a 400 with a one-line error.
    let (status, answer) = post(&hook, &json!({"kind": "Pod"}));
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(
        answer["error"].as_str().is_some_and(|e| !e.contains('\n')),
        "{answer}"
    );
}

#[test]
fn a_trainer_config_annotation_states_the_rest_of_the_job() {
    let hook = hook(Sharing::Hami);
    let mut review = fixture("deployment-pod.json");
    let notes = &mut review["request"]["object"]["metadata"]["annotations"];
    notes.as_object_mut().unwrap().remove("gpumem.io/batch");
    notes["gpumem.io/train-config"] =
        json!("per_device_train_batch_size: 256\noptim: sgd\noutput_dir: out\n");
    let (pod, warnings) = admitted(&hook, &review);
    assert!(warnings.is_empty(), "{warnings:?}");
    let limits = &pod["spec"]["containers"][0]["resources"]["limits"];
    // The config's micro-batch and optimizer, as if annotated batch=256 optimizer=sgd.
    assert_eq!(
        limits["nvidia.com/gpumem"],
        upper_bound_mib("mlp:input=4096,output=10,depth=4", 256, "sgd", "a100-80gb").to_string()
    );
    // A config that cannot be read: admitted unchanged, the warning naming the annotation.
    let notes = &mut review["request"]["object"]["metadata"]["annotations"];
    notes["gpumem.io/train-config"] = json!("per_device_train_batch_size: lots\n");
    let (pod, warnings) = admitted(&hook, &review);
    assert_eq!(pod, review["request"]["object"], "unchanged");
    assert!(
        warnings.len() == 1 && warnings[0].contains("gpumem.io/train-config"),
        "{warnings:?}"
    );
}
