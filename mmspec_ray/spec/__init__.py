"""mmspec_ray.spec"""
