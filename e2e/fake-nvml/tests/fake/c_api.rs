//! The fake's C ABI, called exactly as a C client would: through the function table of
//! nvml-wrapper-sys (generated from the NVML header), with raw pointers, NULLs, short
//! buffers and stale handles.
// Calling a C library is unsafe by nature; every call passes valid pointers or deliberate
// NULLs that the NVML contract allows.
#![allow(unsafe_code)]

use std::{
    ffi::{CStr, c_char},
    ptr,
};

use migdra_fake_nvml::{FakeConfig, GpuConfig, code, testing::FakeGpuHost};
use nvml_wrapper_sys::bindings::{
    NvmlLib, nvmlComputeInstance_t, nvmlComputeInstanceInfo_t, nvmlComputeInstancePlacement_t,
    nvmlComputeInstanceProfileInfo_t, nvmlDevice_t, nvmlGpuInstance_t, nvmlGpuInstanceInfo_t,
    nvmlGpuInstancePlacement_t, nvmlGpuInstanceProfileInfo_t, nvmlGpuInstanceProfileInfo_v2_t,
    nvmlGpuInstanceProfileInfo_v3_t, nvmlMemory_t, nvmlProcessInfo_t,
};

macro_rules! f {
    ($lib:expr, $name:ident) => {
        *$lib.$name.as_ref().expect(stringify!($name))
    };
}

struct Loaded {
    lib: NvmlLib,
    // Keeps the host (and its directory) alive as long as the library is used.
    _host: FakeGpuHost,
}

fn load(gpus: &[(&str, bool)]) -> Loaded {
    let host = FakeGpuHost::with_gpus(gpus).expect("host");
    // SAFETY: the library is the fake; loading it runs no initialisers with preconditions.
    let lib = unsafe { NvmlLib::new(host.lib_path()) }.expect("dlopen the fake");
    // SAFETY: no arguments.
    assert_eq!(unsafe { f!(lib, nvmlInit_v2)() }, code::SUCCESS);
    Loaded { lib, _host: host }
}

fn device(lib: &NvmlLib, index: u32) -> nvmlDevice_t {
    let mut dev: nvmlDevice_t = ptr::null_mut();
    // SAFETY: valid out pointer.
    assert_eq!(
        unsafe { f!(lib, nvmlDeviceGetHandleByIndex_v2)(index, &mut dev) },
        code::SUCCESS
    );
    dev
}

fn create_gi(
    lib: &NvmlLib,
    dev: nvmlDevice_t,
    profile: u32,
    start: u32,
    size: u32,
) -> (u32, nvmlGpuInstance_t) {
    let mut gi: nvmlGpuInstance_t = ptr::null_mut();
    let placement = nvmlGpuInstancePlacement_t { start, size };
    // SAFETY: valid pointers.
    let rc = unsafe { f!(lib, nvmlDeviceCreateGpuInstanceWithPlacement)(dev, profile, &placement, &mut gi) };
    (rc, gi)
}

fn create_ci(lib: &NvmlLib, gi: nvmlGpuInstance_t, profile: u32) -> (u32, nvmlComputeInstance_t) {
    let mut ci: nvmlComputeInstance_t = ptr::null_mut();
    // SAFETY: valid pointers.
    let rc = unsafe { f!(lib, nvmlGpuInstanceCreateComputeInstance)(gi, profile, &mut ci) };
    (rc, ci)
}

fn ci_info(lib: &NvmlLib, ci: nvmlComputeInstance_t) -> (u32, nvmlComputeInstanceInfo_t) {
    let mut info = nvmlComputeInstanceInfo_t {
        device: ptr::null_mut(),
        gpuInstance: ptr::null_mut(),
        id: 99,
        profileId: 99,
        placement: nvmlComputeInstancePlacement_t { start: 99, size: 99 },
    };
    // SAFETY: valid pointers.
    let rc = unsafe { f!(lib, nvmlComputeInstanceGetInfo_v2)(ci, &mut info) };
    (rc, info)
}

fn uuid_of(lib: &NvmlLib, dev: nvmlDevice_t) -> String {
    let mut buf = [0 as c_char; 96];
    // SAFETY: the buffer holds 96 bytes.
    assert_eq!(
        unsafe { f!(lib, nvmlDeviceGetUUID)(dev, buf.as_mut_ptr(), 96) },
        code::SUCCESS
    );
    // SAFETY: NUL-terminated by the callee.
    unsafe { CStr::from_ptr(buf.as_ptr()) }
        .to_string_lossy()
        .into_owned()
}

#[test]
fn calls_before_init_and_unbalanced_shutdown_are_uninitialized() {
    let host = FakeGpuHost::with_gpus(&[("H100-80GB", true)]).unwrap();
    let lib = unsafe { NvmlLib::new(host.lib_path()) }.unwrap();
    let mut count = 0;
    assert_eq!(
        unsafe { f!(lib, nvmlDeviceGetCount_v2)(&mut count) },
        code::UNINITIALIZED
    );
    assert_eq!(unsafe { f!(lib, nvmlShutdown)() }, code::UNINITIALIZED);
    // Init is reference counted: two inits need two shutdowns.
    assert_eq!(unsafe { f!(lib, nvmlInit_v2)() }, code::SUCCESS);
    assert_eq!(unsafe { f!(lib, nvmlInit_v2)() }, code::SUCCESS);
    assert_eq!(unsafe { f!(lib, nvmlShutdown)() }, code::SUCCESS);
    assert_eq!(
        unsafe { f!(lib, nvmlDeviceGetCount_v2)(&mut count) },
        code::SUCCESS
    );
    assert_eq!(count, 1);
    assert_eq!(unsafe { f!(lib, nvmlShutdown)() }, code::SUCCESS);
    assert_eq!(
        unsafe { f!(lib, nvmlDeviceGetCount_v2)(&mut count) },
        code::UNINITIALIZED
    );
    let text = unsafe { CStr::from_ptr(f!(lib, nvmlErrorString)(23)) };
    assert_eq!(text.to_str().unwrap(), "Insufficient Resources");
}

#[test]
fn init_finds_its_config_next_to_the_library_and_creates_the_state() {
    let dir = tempfile::tempdir().unwrap();
    let lib_path = dir.path().join("libnvidia-ml.so.1");
    std::fs::copy(migdra_fake_nvml::testing::fake_library_path().unwrap(), &lib_path).unwrap();
    let lib = unsafe { NvmlLib::new(&lib_path) }.unwrap();
    // No configuration yet: like a machine without the driver.
    assert_eq!(unsafe { f!(lib, nvmlInit_v2)() }, code::DRIVER_NOT_LOADED);
    let config = FakeConfig {
        gpus: vec![GpuConfig {
            count: Some(3),
            ..GpuConfig::new("A30-24GB", true)
        }],
        driver_version: Some("570.86.15".into()),
        ..FakeConfig::default()
    };
    std::fs::write(
        dir.path().join("fake-nvml.json"),
        serde_json::to_string(&config).unwrap(),
    )
    .unwrap();
    assert_eq!(unsafe { f!(lib, nvmlInit_v2)() }, code::SUCCESS);
    let state = migdra_fake_nvml::read_state(&dir.path().join("fake-nvml-state.json")).unwrap();
    assert_eq!(state.gpus.len(), 3);
    assert_eq!(
        state.gpus.iter().map(|g| g.minor).collect::<Vec<_>>(),
        vec![0, 1, 2]
    );
    assert!(
        dir.path()
            .join("proc-root/driver/nvidia-caps/mig-minors")
            .exists()
    );

    let mut buf = [0 as c_char; 80];
    assert_eq!(
        unsafe { f!(lib, nvmlSystemGetDriverVersion)(buf.as_mut_ptr(), 80) },
        code::SUCCESS
    );
    assert_eq!(
        unsafe { CStr::from_ptr(buf.as_ptr()) }.to_str().unwrap(),
        "570.86.15"
    );
    assert_eq!(
        unsafe { f!(lib, nvmlSystemGetDriverVersion)(buf.as_mut_ptr(), 5) },
        code::INSUFFICIENT_SIZE
    );
    assert_eq!(
        unsafe { f!(lib, nvmlSystemGetDriverVersion)(ptr::null_mut(), 80) },
        code::INVALID_ARGUMENT
    );
    assert_eq!(unsafe { f!(lib, nvmlShutdown)() }, code::SUCCESS);
}

#[test]
fn placements_support_count_queries_and_report_short_buffers() {
    let l = load(&[("H100-80GB", false)]);
    let dev = device(&l.lib, 0);
    let f = f!(l.lib, nvmlDeviceGetGpuInstancePossiblePlacements_v2);
    let mut count = 0;
    // MIG is off: placements still work (count-only call with a NULL array).
    assert_eq!(unsafe { f(dev, 19, ptr::null_mut(), &mut count) }, code::SUCCESS);
    assert_eq!(count, 7);
    let mut buf = [nvmlGpuInstancePlacement_t { start: 99, size: 99 }; 7];
    let mut short = 3;
    assert_eq!(
        unsafe { f(dev, 19, buf.as_mut_ptr(), &mut short) },
        code::INSUFFICIENT_SIZE
    );
    assert_eq!(short, 7);
    assert_eq!(buf[0].start, 99, "nothing written into a short buffer");
    let mut count = 7;
    assert_eq!(unsafe { f(dev, 15, buf.as_mut_ptr(), &mut count) }, code::SUCCESS);
    assert_eq!(count, 4);
    assert_eq!(
        buf[..4].iter().map(|p| (p.start, p.size)).collect::<Vec<_>>(),
        vec![(0, 2), (2, 2), (4, 2), (6, 2)]
    );
    assert_eq!(
        unsafe { f(dev, 19, buf.as_mut_ptr(), ptr::null_mut()) },
        code::INVALID_ARGUMENT
    );
    assert_eq!(
        unsafe { f(dev, 3, ptr::null_mut(), &mut count) },
        code::INVALID_ARGUMENT,
        "unknown ID"
    );
}

#[test]
fn profile_info_takes_indexes_and_returns_real_ids() {
    let l = load(&[("A100-SXM4-40GB", false), ("H100-80GB", true), ("L4", false)]);
    let get = f!(l.lib, nvmlDeviceGetGpuInstanceProfileInfo);
    let a100 = device(&l.lib, 0);
    let mut info: nvmlGpuInstanceProfileInfo_t = unsafe { std::mem::zeroed() };
    assert_eq!(unsafe { get(a100, 0, &mut info) }, code::SUCCESS);
    assert_eq!(
        (info.id, info.sliceCount, info.instanceCount, info.memorySizeMB),
        (19, 1, 7, 4864)
    );
    assert_eq!(unsafe { get(a100, 9, &mut info) }, code::SUCCESS);
    assert_eq!(info.id, 15);
    assert_eq!(
        unsafe { get(a100, 5, &mut info) },
        code::NOT_SUPPORTED,
        "8_SLICE is not on A100"
    );
    assert_eq!(
        unsafe { get(a100, 18, &mut info) },
        code::INVALID_ARGUMENT,
        "index >= COUNT"
    );
    assert_eq!(unsafe { get(a100, 0, ptr::null_mut()) }, code::INVALID_ARGUMENT);
    assert_eq!(
        unsafe { get(device(&l.lib, 2), 0, &mut info) },
        code::NOT_SUPPORTED,
        "no MIG on L4"
    );

    // Versioned info: name and version; needs MIG mode on.
    let get_v = f!(l.lib, nvmlDeviceGetGpuInstanceProfileInfoV);
    let mut v3: nvmlGpuInstanceProfileInfo_v3_t = unsafe { std::mem::zeroed() };
    v3.version = 0x0300_0098;
    let v3_ptr = ptr::from_mut(&mut v3).cast::<nvmlGpuInstanceProfileInfo_v2_t>();
    assert_eq!(unsafe { get_v(a100, 0, v3_ptr) }, code::NOT_SUPPORTED);
    let h100 = device(&l.lib, 1);
    assert_eq!(unsafe { get_v(h100, 7, v3_ptr) }, code::SUCCESS);
    assert_eq!(v3.id, 20);
    assert_eq!(
        unsafe { CStr::from_ptr(v3.name.as_ptr()) }.to_str().unwrap(),
        "MIG 1g.10gb+me"
    );
    let mut v2: nvmlGpuInstanceProfileInfo_v2_t = unsafe { std::mem::zeroed() };
    v2.version = 0x0200_0098;
    assert_eq!(
        unsafe { f!(l.lib, nvmlDeviceGetGpuInstanceProfileInfoByIdV)(h100, 9, &mut v2) },
        code::SUCCESS
    );
    assert_eq!((v2.sliceCount, v2.memorySizeMB), (3, 40448));
    assert_eq!(
        unsafe { CStr::from_ptr(v2.name.as_ptr()) }.to_str().unwrap(),
        "MIG 3g.40gb"
    );
    v2.version = 0x0100_0098;
    assert_eq!(
        unsafe { get_v(h100, 0, &mut v2) },
        code::ARGUMENT_VERSION_MISMATCH
    );
}

#[test]
fn gpu_instance_calls_follow_nvml() {
    let l = load(&[("H100-80GB", true), ("A100-80GB", false)]);
    let dev = device(&l.lib, 0);
    // Size must match the profile.
    assert_eq!(create_gi(&l.lib, dev, 9, 4, 2).0, code::INVALID_ARGUMENT);
    let (rc, gi) = create_gi(&l.lib, dev, 9, 4, 4);
    assert_eq!(rc, code::SUCCESS);
    assert_eq!(
        create_gi(&l.lib, dev, 9, 4, 4).0,
        code::INSUFFICIENT_RESOURCES,
        "identical instance"
    );
    let mut info = nvmlGpuInstanceInfo_t {
        device: ptr::null_mut(),
        id: 99,
        profileId: 99,
        placement: nvmlGpuInstancePlacement_t { start: 99, size: 99 },
    };
    assert_eq!(
        unsafe { f!(l.lib, nvmlGpuInstanceGetInfo)(gi, &mut info) },
        code::SUCCESS
    );
    assert_eq!(
        (info.id, info.profileId, info.placement.start, info.placement.size),
        (2, 9, 4, 4)
    );
    assert_eq!(info.device, dev, "the parent handle is the device's handle");

    let mut remaining = 0;
    assert_eq!(
        unsafe { f!(l.lib, nvmlDeviceGetGpuInstanceRemainingCapacity)(dev, 19, &mut remaining) },
        0
    );
    assert_eq!(remaining, 4);

    // Auto placement tries 6, 4, 5 first; the 3g covers 4-7, so the 1g lands at 0.
    let mut auto: nvmlGpuInstance_t = ptr::null_mut();
    assert_eq!(
        unsafe { f!(l.lib, nvmlDeviceCreateGpuInstance)(dev, 19, &mut auto) },
        code::SUCCESS
    );
    assert_eq!(
        unsafe { f!(l.lib, nvmlGpuInstanceGetInfo)(auto, &mut info) },
        code::SUCCESS
    );
    assert_eq!(
        info.placement.start, 0,
        "first free start of the order 6, 4, 5, 0, ..."
    );

    let mut list = [ptr::null_mut(); 7];
    let mut count = 0;
    assert_eq!(
        unsafe { f!(l.lib, nvmlDeviceGetGpuInstances)(dev, 9, list.as_mut_ptr(), &mut count) },
        0
    );
    assert_eq!((count, list[0]), (1, gi), "the same handle for the same instance");
    let mut by_id: nvmlGpuInstance_t = ptr::null_mut();
    assert_eq!(
        unsafe { f!(l.lib, nvmlDeviceGetGpuInstanceById)(dev, 3, &mut by_id) },
        code::NOT_FOUND
    );

    assert_eq!(unsafe { f!(l.lib, nvmlGpuInstanceDestroy)(gi) }, code::SUCCESS);
    // The handle is stale now.
    assert_eq!(
        unsafe { f!(l.lib, nvmlGpuInstanceGetInfo)(gi, &mut info) },
        code::INVALID_ARGUMENT
    );
    assert_eq!(
        unsafe { f!(l.lib, nvmlGpuInstanceDestroy)(gi) },
        code::INVALID_ARGUMENT
    );
    // A pointer the library never handed out is rejected, not dereferenced.
    let mut bogus = 0u64;
    let bogus_gi = ptr::from_mut(&mut bogus).cast();
    assert_eq!(
        unsafe { f!(l.lib, nvmlGpuInstanceDestroy)(bogus_gi) },
        code::INVALID_ARGUMENT
    );

    // MIG off: instance calls are not supported, profile info is.
    let off = device(&l.lib, 1);
    assert_eq!(create_gi(&l.lib, off, 19, 0, 1).0, code::NOT_SUPPORTED);
    assert_eq!(
        unsafe { f!(l.lib, nvmlDeviceGetGpuInstanceById)(off, 0, &mut by_id) },
        code::NOT_SUPPORTED
    );
    assert_eq!(
        unsafe { f!(l.lib, nvmlDeviceGetGpuInstanceRemainingCapacity)(off, 19, &mut remaining) },
        3
    );
    assert_eq!(
        unsafe { f!(l.lib, nvmlDeviceGetGpuInstances)(off, 19, list.as_mut_ptr(), &mut count) },
        code::NOT_SUPPORTED
    );
}

#[test]
fn compute_instances_follow_the_size_rule() {
    let l = load(&[("H100-80GB", true)]);
    let dev = device(&l.lib, 0);
    let (_, gi7) = create_gi(&l.lib, dev, 0, 0, 8);
    let get = f!(l.lib, nvmlGpuInstanceGetComputeInstanceProfileInfo);
    let mut info: nvmlComputeInstanceProfileInfo_t = unsafe { std::mem::zeroed() };
    assert_eq!(unsafe { get(gi7, 2, 0, &mut info) }, code::SUCCESS);
    assert_eq!((info.id, info.sliceCount, info.instanceCount), (2, 3, 2));
    assert_eq!(
        unsafe { get(gi7, 8, 0, &mut info) },
        code::NOT_SUPPORTED,
        "7_SLICE_NVL"
    );
    assert_eq!(
        unsafe { get(gi7, 7, 0, &mut info) },
        code::NOT_SUPPORTED,
        "REV1 is for 1-slice GIs"
    );
    assert_eq!(unsafe { get(gi7, 9, 0, &mut info) }, code::INVALID_ARGUMENT);
    assert_eq!(
        unsafe { get(gi7, 0, 1, &mut info) },
        code::INVALID_ARGUMENT,
        "engine profile"
    );

    let (rc, a) = create_ci(&l.lib, gi7, 3);
    assert_eq!(rc, code::SUCCESS);
    assert_eq!(
        create_ci(&l.lib, gi7, 3).0,
        code::INSUFFICIENT_RESOURCES,
        "one 4c per 7g"
    );
    let (_, b) = create_ci(&l.lib, gi7, 2);
    assert_eq!(
        create_ci(&l.lib, gi7, 0).0,
        code::INSUFFICIENT_RESOURCES,
        "all compute slices taken"
    );
    let (_, ia) = ci_info(&l.lib, a);
    let (_, ib) = ci_info(&l.lib, b);
    assert_eq!((ia.id, ia.placement.start, ia.placement.size), (0, 0, 4));
    assert_eq!((ib.id, ib.placement.start, ib.placement.size), (1, 4, 3));

    let mut capacity = 9;
    let remaining = f!(l.lib, nvmlGpuInstanceGetComputeInstanceRemainingCapacity);
    assert_eq!(unsafe { remaining(gi7, 0, &mut capacity) }, code::SUCCESS);
    assert_eq!(capacity, 0);
    assert_eq!(unsafe { f!(l.lib, nvmlComputeInstanceDestroy)(a) }, code::SUCCESS);
    assert_eq!(unsafe { remaining(gi7, 0, &mut capacity) }, code::SUCCESS);
    assert_eq!(capacity, 4);
    assert_eq!(ci_info(&l.lib, a).0, code::INVALID_ARGUMENT, "stale CI handle");
    let (_, c) = create_ci(&l.lib, gi7, 0);
    assert_eq!(ci_info(&l.lib, c).1.id, 0, "lowest free CI ID");
    let mut by_id: nvmlComputeInstance_t = ptr::null_mut();
    assert_eq!(
        unsafe { f!(l.lib, nvmlGpuInstanceGetComputeInstanceById)(gi7, 5, &mut by_id) },
        code::NOT_FOUND
    );
    assert_eq!(
        unsafe { f!(l.lib, nvmlGpuInstanceGetComputeInstanceById)(gi7, 1, &mut by_id) },
        code::SUCCESS
    );
    assert_eq!(by_id, b);

    assert_eq!(
        unsafe { f!(l.lib, nvmlGpuInstanceDestroy)(gi7) },
        code::IN_USE,
        "it still has CIs"
    );
}

#[test]
fn one_slice_instances_take_either_full_compute_profile() {
    let l = load(&[("GH200-144GB", true)]);
    let dev = device(&l.lib, 0);
    let (_, gi) = create_gi(&l.lib, dev, 15, 2, 2);
    let (rc, ci) = create_ci(&l.lib, gi, 7);
    assert_eq!(rc, code::SUCCESS);
    assert_eq!(ci_info(&l.lib, ci).1.profileId, 7);
    assert_eq!(create_ci(&l.lib, gi, 0).0, code::INSUFFICIENT_RESOURCES);
}

#[test]
fn mig_device_handles_are_ordered_and_answer_queries() {
    let l = load(&[("H100-80GB", true), ("H100-80GB", false)]);
    let dev = device(&l.lib, 0);
    let (_, gi_high) = create_gi(&l.lib, dev, 19, 6, 1); // GI 13
    let (_, gi_low) = create_gi(&l.lib, dev, 9, 0, 4); // GI 1
    let (_, ci_high) = create_ci(&l.lib, gi_high, 0);
    let (_, ci_low_b) = create_ci(&l.lib, gi_low, 0);
    let (_, ci_low_a) = create_ci(&l.lib, gi_low, 0);

    let mut max = 0;
    assert_eq!(
        unsafe { f!(l.lib, nvmlDeviceGetMaxMigDeviceCount)(dev, &mut max) },
        code::SUCCESS
    );
    assert_eq!(max, 7);
    let by_index = |i: u32| {
        let mut mig: nvmlDevice_t = ptr::null_mut();
        let rc = unsafe { f!(l.lib, nvmlDeviceGetMigDeviceHandleByIndex)(dev, i, &mut mig) };
        (rc, mig)
    };
    let order: Vec<(u32, u32)> = (0..3)
        .map(|i| {
            let (rc, mig) = by_index(i);
            assert_eq!(rc, code::SUCCESS);
            let (mut g, mut c) = (0, 0);
            assert_eq!(unsafe { f!(l.lib, nvmlDeviceGetGpuInstanceId)(mig, &mut g) }, 0);
            assert_eq!(
                unsafe { f!(l.lib, nvmlDeviceGetComputeInstanceId)(mig, &mut c) },
                0
            );
            (g, c)
        })
        .collect();
    assert_eq!(order, vec![(1, 0), (1, 1), (13, 0)], "ordered by (GI ID, CI ID)");
    assert_eq!(by_index(3).0, code::NOT_FOUND, "empty slot");
    assert_eq!(by_index(7).0, code::INVALID_ARGUMENT, "beyond the maximum");

    // The MIG handle from the CI info is the one the index walk returns.
    let (_, info) = ci_info(&l.lib, ci_high);
    assert_eq!(info.device, by_index(2).1);
    assert_eq!(info.gpuInstance, gi_high);
    let mig = info.device;
    let uuid = uuid_of(&l.lib, mig);
    assert!(uuid.starts_with("MIG-") && uuid.len() == 40, "{uuid}");
    assert_ne!(uuid, uuid_of(&l.lib, ci_info(&l.lib, ci_low_a).1.device));
    assert_ne!(uuid, uuid_of(&l.lib, ci_info(&l.lib, ci_low_b).1.device));
    let mut is_mig = 9;
    assert_eq!(
        unsafe { f!(l.lib, nvmlDeviceIsMigDeviceHandle)(mig, &mut is_mig) },
        0
    );
    assert_eq!(is_mig, 1);
    assert_eq!(
        unsafe { f!(l.lib, nvmlDeviceIsMigDeviceHandle)(dev, &mut is_mig) },
        0
    );
    assert_eq!(is_mig, 0);
    let mut parent: nvmlDevice_t = ptr::null_mut();
    assert_eq!(
        unsafe { f!(l.lib, nvmlDeviceGetDeviceHandleFromMigDeviceHandle)(mig, &mut parent) },
        0
    );
    assert_eq!(parent, dev);
    let mut memory = nvmlMemory_t {
        total: 0,
        free: 0,
        used: 0,
    };
    assert_eq!(unsafe { f!(l.lib, nvmlDeviceGetMemoryInfo)(mig, &mut memory) }, 0);
    assert_eq!(memory.total, 9984 * 1024 * 1024, "the 1g GI's memory");
    let mut g = 0;
    assert_eq!(
        unsafe { f!(l.lib, nvmlDeviceGetGpuInstanceId)(dev, &mut g) },
        code::NOT_SUPPORTED
    );
    let mut found: nvmlDevice_t = ptr::null_mut();
    let c_uuid = std::ffi::CString::new(uuid.clone()).unwrap();
    assert_eq!(
        unsafe { f!(l.lib, nvmlDeviceGetHandleByUUID)(c_uuid.as_ptr(), &mut found) },
        0
    );
    assert_eq!(found, mig);

    // Short UUID buffer.
    let mut short = [0 as c_char; 10];
    assert_eq!(
        unsafe { f!(l.lib, nvmlDeviceGetUUID)(mig, short.as_mut_ptr(), 10) },
        code::INSUFFICIENT_SIZE
    );

    // Destroying the CI makes its MIG handle stale.
    assert_eq!(unsafe { f!(l.lib, nvmlComputeInstanceDestroy)(ci_high) }, 0);
    let mut buf = [0 as c_char; 96];
    assert_eq!(
        unsafe { f!(l.lib, nvmlDeviceGetUUID)(mig, buf.as_mut_ptr(), 96) },
        code::INVALID_ARGUMENT
    );

    let off = device(&l.lib, 1);
    assert_eq!(
        unsafe { f!(l.lib, nvmlDeviceGetMaxMigDeviceCount)(off, &mut max) },
        code::SUCCESS
    );
    assert_eq!(max, 0);
}

#[test]
fn mig_mode_calls_report_activation_status() {
    let l = load(&[("A100-80GB", false), ("B200", false), ("T4", false)]);
    let set = f!(l.lib, nvmlDeviceSetMigMode);
    let get = f!(l.lib, nvmlDeviceGetMigMode);
    let (mut current, mut pending, mut status) = (9, 9, 9);
    // An idle bare-metal A100: the driver resets it itself, the mode applies (§12).
    let a100 = device(&l.lib, 0);
    assert_eq!(unsafe { set(a100, 1, &mut status) }, code::SUCCESS);
    assert_eq!(status, code::SUCCESS);
    assert_eq!(unsafe { get(a100, &mut current, &mut pending) }, code::SUCCESS);
    assert_eq!((current, pending), (1, 1));
    let b200 = device(&l.lib, 1);
    assert_eq!(unsafe { set(b200, 1, &mut status) }, code::SUCCESS);
    assert_eq!(status, code::SUCCESS);
    assert_eq!(unsafe { get(b200, &mut current, &mut pending) }, code::SUCCESS);
    assert_eq!((current, pending), (1, 1));
    assert_eq!(unsafe { set(b200, 2, &mut status) }, code::INVALID_ARGUMENT);
    assert_eq!(unsafe { set(b200, 1, ptr::null_mut()) }, code::INVALID_ARGUMENT);
    let t4 = device(&l.lib, 2);
    assert_eq!(
        unsafe { get(t4, &mut current, &mut pending) },
        code::NOT_SUPPORTED
    );
    assert_eq!(unsafe { set(t4, 1, &mut status) }, code::NOT_SUPPORTED);
}

#[test]
fn handles_go_by_index_and_minors_by_the_configured_minor() {
    // Index 0 has minor 1, index 1 minor 0, as on a machine whose PCI order differs from
    // the driver's numbering.
    let host = FakeGpuHost::new(FakeConfig {
        gpus: vec![
            GpuConfig::new("H100-80GB", true).with_minor(1),
            GpuConfig::new("A100-80GB", true).with_minor(0),
        ],
        ..FakeConfig::default()
    })
    .unwrap();
    let lib = unsafe { NvmlLib::new(host.lib_path()) }.unwrap();
    assert_eq!(unsafe { f!(lib, nvmlInit_v2)() }, code::SUCCESS);
    let mut buf = [0 as c_char; 96];
    for (index, minor, name) in [(0, 1, "NVIDIA H100 80GB HBM3"), (1, 0, "NVIDIA A100-SXM4-80GB")] {
        let dev = device(&lib, index);
        let (mut got_index, mut got_minor) = (99, 99);
        assert_eq!(
            unsafe { f!(lib, nvmlDeviceGetIndex)(dev, &mut got_index) },
            code::SUCCESS
        );
        assert_eq!(
            unsafe { f!(lib, nvmlDeviceGetMinorNumber)(dev, &mut got_minor) },
            code::SUCCESS
        );
        assert_eq!((got_index, got_minor), (index, minor));
        assert_eq!(
            unsafe { f!(lib, nvmlDeviceGetName)(dev, buf.as_mut_ptr(), 96) },
            code::SUCCESS
        );
        assert_eq!(unsafe { CStr::from_ptr(buf.as_ptr()) }.to_str().unwrap(), name);
    }
    // A GPU instance on index 0 gets its capability files under the GPU's minor, 1.
    let (rc, _) = create_gi(&lib, device(&lib, 0), 9, 4, 4);
    assert_eq!(rc, code::SUCCESS);
    let caps = host.proc_root().join("driver/nvidia/capabilities");
    let access = std::fs::read_to_string(caps.join("gpu1/mig/gi2/access")).unwrap();
    assert!(
        access.contains(&format!(
            "DeviceFileMinor: {}\n",
            migdra_fake_nvml::procfs::gi_cap_minor(1, 2)
        )),
        "{access}"
    );
    assert!(
        !caps.join("gpu0/mig/gi2").exists(),
        "nothing under the other GPU's minor"
    );
    let state = host.read_state().unwrap();
    assert_eq!(state.gpus[0].gpu_instances.len(), 1);
    assert!(state.gpus[1].gpu_instances.is_empty());
}

#[test]
fn a_minor_given_twice_is_a_configuration_error() {
    let config = FakeConfig {
        gpus: vec![
            GpuConfig {
                count: Some(2),
                ..GpuConfig::new("H100-80GB", true).with_minor(3)
            },
            GpuConfig::new("H100-80GB", true).with_minor(4),
        ],
        ..FakeConfig::default()
    };
    let err = migdra_fake_nvml::state::FakeState::from_config(&config, std::path::Path::new("unused"))
        .unwrap_err()
        .to_string();
    assert!(err.contains("device minor 4") && err.contains("unique"), "{err}");
    // Without the clash the group counts up from its minor, the rest default to the index.
    let config = FakeConfig {
        gpus: vec![
            GpuConfig {
                count: Some(2),
                ..GpuConfig::new("H100-80GB", true).with_minor(3)
            },
            GpuConfig::new("H100-80GB", true),
        ],
        ..FakeConfig::default()
    };
    let state =
        migdra_fake_nvml::state::FakeState::from_config(&config, std::path::Path::new("unused")).unwrap();
    let numbering: Vec<(u32, u32)> = state.gpus.iter().map(|g| (g.index, g.minor)).collect();
    assert_eq!(numbering, vec![(0, 3), (1, 4), (2, 2)]);
}

#[test]
fn the_single_ofa_goes_to_one_instance_and_remaining_capacity_says_so() {
    let l = load(&[("A30-24GB", true)]);
    let dev = device(&l.lib, 0);
    let remaining = |profile: u32| {
        let mut n = 99;
        assert_eq!(
            unsafe { f!(l.lib, nvmlDeviceGetGpuInstanceRemainingCapacity)(dev, profile, &mut n) },
            code::SUCCESS
        );
        n
    };
    assert_eq!((remaining(21), remaining(6)), (1, 1));
    // 1g.6gb+me at slice 0 takes the OFA ...
    let (rc, me) = create_gi(&l.lib, dev, 21, 0, 1);
    assert_eq!(rc, code::SUCCESS);
    assert_eq!((remaining(21), remaining(6)), (0, 0));
    // ... so 2g.12gb+me on the free slices 2-3 cannot have it; a plain 2g can.
    assert_eq!(create_gi(&l.lib, dev, 6, 2, 2).0, code::INSUFFICIENT_RESOURCES);
    assert_eq!(remaining(5), 1);
    assert_eq!(create_gi(&l.lib, dev, 5, 2, 2).0, code::SUCCESS);
    assert_eq!(unsafe { f!(l.lib, nvmlGpuInstanceDestroy)(me) }, code::SUCCESS);
    assert_eq!(remaining(6), 1);
    assert_eq!(create_gi(&l.lib, dev, 6, 0, 2).0, code::SUCCESS);
}

#[test]
fn the_call_log_counts_calls_by_name_only_when_turned_on() {
    let loaded = load(&[("H100-80GB", true)]);
    let lib = &loaded.lib;
    let count = |lib: &NvmlLib| {
        let mut n = 0u32;
        // SAFETY: valid out pointer.
        assert_eq!(unsafe { f!(lib, nvmlDeviceGetCount_v2)(&mut n) }, code::SUCCESS);
    };
    count(lib);
    assert_eq!(
        loaded._host.read_state().unwrap().call_log,
        None,
        "off by default"
    );
    loaded
        ._host
        .update_state(|s| s.call_log = Some(Default::default()))
        .unwrap();
    count(lib);
    count(lib);
    let dev = device(lib, 0);
    let mut minor = 0u32;
    // SAFETY: valid device handle and out pointer.
    assert_eq!(
        unsafe { f!(lib, nvmlDeviceGetMinorNumber)(dev, &mut minor) },
        code::SUCCESS
    );
    let log = loaded._host.read_state().unwrap().call_log.unwrap();
    assert_eq!(log.get("nvmlDeviceGetCount_v2"), Some(&2));
    assert_eq!(log.get("nvmlDeviceGetMinorNumber"), Some(&1));
    assert_eq!(log.get("nvmlDeviceGetHandleByIndex_v2"), Some(&1));
}

#[test]
fn running_process_lists_follow_the_count_protocol_and_split_by_kind() {
    let l = load(&[("H100-80GB", true)]);
    let dev = device(&l.lib, 0);
    let compute = f!(l.lib, nvmlDeviceGetComputeRunningProcesses_v3);
    let graphics = f!(l.lib, nvmlDeviceGetGraphicsRunningProcesses_v3);
    let mut count = 0;
    // No process: SUCCESS and 0, even for a count-only call.
    assert_eq!(
        unsafe { compute(dev, &mut count, ptr::null_mut()) },
        code::SUCCESS
    );
    assert_eq!(count, 0);
    l._host
        .update_state(|s| {
            use migdra_fake_nvml::state::{ClientKind, GpuClient};
            for (pid, kind) in [
                (11, ClientKind::Compute),
                (12, ClientKind::Compute),
                (13, ClientKind::Graphics),
            ] {
                s.gpus[0].clients.push(GpuClient {
                    kind,
                    ..GpuClient::compute(pid, "app", 1)
                });
            }
            // An NVML session has no context: neither list shows it.
            s.gpus[0]
                .clients
                .push(GpuClient::nvml_session(14, "nv-hostengine"));
        })
        .unwrap();
    let empty = nvmlProcessInfo_t {
        pid: 0,
        usedGpuMemory: 0,
        gpuInstanceId: 0,
        computeInstanceId: 0,
    };
    let mut buf = [empty; 4];
    let mut count = 0;
    assert_eq!(
        unsafe { compute(dev, &mut count, ptr::null_mut()) },
        code::INSUFFICIENT_SIZE
    );
    assert_eq!(count, 2);
    let mut short = 1;
    assert_eq!(
        unsafe { compute(dev, &mut short, buf.as_mut_ptr()) },
        code::INSUFFICIENT_SIZE
    );
    assert_eq!((short, buf[0].pid), (2, 0), "nothing written into a short buffer");
    let mut count = 4;
    assert_eq!(
        unsafe { compute(dev, &mut count, buf.as_mut_ptr()) },
        code::SUCCESS
    );
    assert_eq!(count, 2);
    assert_eq!(
        buf[..2]
            .iter()
            .map(|p| (p.pid, p.gpuInstanceId, p.computeInstanceId))
            .collect::<Vec<_>>(),
        [(11, u32::MAX, u32::MAX), (12, u32::MAX, u32::MAX)]
    );
    let mut count = 4;
    assert_eq!(
        unsafe { graphics(dev, &mut count, buf.as_mut_ptr()) },
        code::SUCCESS
    );
    assert_eq!((count, buf[0].pid), (1, 13));
    assert_eq!(
        unsafe { compute(dev, ptr::null_mut(), buf.as_mut_ptr()) },
        code::INVALID_ARGUMENT
    );
}
