//! The buffer pool's huge pages, opt-in, seen from outside the library (its own binary: the
//! setting is one per process): a large output asks Linux for transparent huge pages only after
//! `buffer_pool::set_huge_pages(true)`. The test reads the process's mappings from
//! `/proc/self/smaps`; the library reads nothing from `/proc` or `/sys`.

#[cfg(target_os = "linux")]
#[test]
fn large_outputs_ask_for_huge_pages_only_when_turned_on() {
    use burn::tensor::{Device, Distribution, Tensor};
    use mha::{MhaInput, MultiHeadAttentionConfig, buffer_pool};

    if !std::path::Path::new("/sys/kernel/mm/transparent_hugepage/enabled").exists() {
        return; // a kernel without transparent huge pages: nothing to ask for
    }
    let device = Device::flex();
    let module = MultiHeadAttentionConfig::new(64, 4).init(&device);
    // 163840 query rows against 4 keys: outputs of 40 MiB (over glibc's largest mmap
    // threshold, so each is a mapping of its own) for little arithmetic.
    let query = Tensor::<3>::random([1, 163_840, 64], Distribution::Default, &device);
    let memory = Tensor::<3>::random([1, 4, 64], Distribution::Default, &device);
    let mut outputs = Vec::new();
    for on in [false, true] {
        buffer_pool::release();
        buffer_pool::set_huge_pages(on);
        let input = MhaInput::new(query.clone(), memory.clone(), memory.clone());
        let output = module.forward(input).context;
        let advised = advised_bytes();
        assert_eq!(
            advised >= 32 << 20,
            on,
            "huge pages {}: {advised} bytes of mappings carry the advice",
            if on { "on" } else { "off" }
        );
        outputs.push(output.into_data());
    }
    // The advice changes how pages are backed, never what they hold.
    assert_eq!(
        outputs[0], outputs[1],
        "the same outputs with huge pages on and off"
    );
    buffer_pool::set_huge_pages(false);
    buffer_pool::release();
}

/// Bytes of this process's mappings that carry the huge-page advice (the `hg` flag).
#[cfg(target_os = "linux")]
fn advised_bytes() -> usize {
    let smaps = std::fs::read_to_string("/proc/self/smaps").expect("/proc/self/smaps");
    let mut size = 0;
    let mut advised = 0;
    for line in smaps.lines() {
        let range = line.split_whitespace().next().and_then(|field| {
            let (start, end) = field.split_once('-')?;
            Some((
                usize::from_str_radix(start, 16).ok()?,
                usize::from_str_radix(end, 16).ok()?,
            ))
        });
        if let Some((start, end)) = range {
            size = end - start;
        } else if let Some(flags) = line.strip_prefix("VmFlags:")
            && flags.split_whitespace().any(|flag| flag == "hg")
        {
            advised += size;
        }
    }
    advised
}
